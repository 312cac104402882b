"""Probe (2026-12-03): does the frozen SmolLM2 describe a scene when the 64 image tokens are replaced by exact word
embeddings of its description (layouts A: the alignment stage's rows, B: the description repeated, C: the
description then newlines, D: each quadrant's sentence in its block of 16)? 24 held-out scenes: 0% in every
layout (it describes freely, never in the trained format)."""
import torch, sys, time
from transformers import AutoTokenizer, AutoModelForCausalLM
from hf_adaptive_spec.scenes import make_scenes, DESCRIBE_REQUEST, scene_messages
from hf_adaptive_spec.scenes_vlm import CHAT_TEMPLATE, IMAGE_TOKEN_ID
from hf_adaptive_spec.training.vlm import align_token_ids, parse_description, POSITIONS
import os; p=os.path.expanduser('~/.cache/hf_adaptive_spec/models/smollm2-135m-instruct')
tok=AutoTokenizer.from_pretrained(p); lm=AutoModelForCausalLM.from_pretrained(p).eval()
scenes=make_scenes('test',24,seed=0)
emb=lm.get_input_embeddings()
def layoutA(s): return align_token_ids([s],tok,8)[0]
def layoutB(s):
    ids=tok(s.description,add_special_tokens=False)['input_ids']
    out=(ids*3)[:64]; return torch.tensor(out)
def layoutC(s):
    ids=tok(s.description,add_special_tokens=False)['input_ids']
    nl=tok("\n",add_special_tokens=False)['input_ids'][0]
    return torch.tensor(ids+[nl]*(64-len(ids)))
def layoutD(s):  # per quadrant block of 16: " Top left: a red circle." repeated
    out=[]
    for (name,_,_),(c,h) in zip(POSITIONS,s.objects):
        ids=tok(f" {name.capitalize()}: a {c} {h}.",add_special_tokens=False)['input_ids']
        out+=(ids*4)[:16]
    return torch.tensor(out)
for name,lay in [('A',layoutA),('B',layoutB),('C',layoutC),('D',layoutD)]:
    col=shp=0
    for i,s in enumerate(scenes):
        prompt=tok.apply_chat_template(scene_messages(DESCRIBE_REQUEST),add_generation_prompt=True,tokenize=False,chat_template=CHAT_TEMPLATE)
        ids=tok(prompt,return_tensors='pt')['input_ids'][0]
        k=(ids==IMAGE_TOKEN_ID).nonzero()[0].item()
        ids=torch.cat([ids[:k],torch.full((64,),IMAGE_TOKEN_ID),ids[k+1:]])
        e=emb(ids[None]).detach().clone()
        e[0,k:k+64]=emb(lay(s)).detach()
        out=lm.generate(inputs_embeds=e,attention_mask=torch.ones(1,e.shape[1],dtype=torch.long),max_new_tokens=40,do_sample=False)
        text=tok.decode(out[0],skip_special_tokens=True)
        r=parse_description(text)
        for (n,_,_),(c,h) in zip(POSITIONS,s.objects):
            col+=r.get(n,(None,None))[0]==c; shp+=r.get(n,(None,None))[1]==h
        if i<2: print(name, repr(text[:160]))
    print(name,'colour',col/96,'shape',shp/96,flush=True)
