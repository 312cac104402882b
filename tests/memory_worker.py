"""Run as a script (a fresh process): the peak memory growth of one call on a tiny long-context target, as
`hf-adaptive-spec bench --memory` measures it (`bench.memory.measure_call`), printed as one JSON line.

Arguments: a JSON object with `method` ("plain" or a strategy), `prompt_tokens`, `cold` (bool)."""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

import torch  # noqa: E402

import hf_adaptive_spec  # noqa: E402,F401  (the generate hook)
from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel  # noqa: E402
from hf_adaptive_spec.bench.memory import measure_call  # noqa: E402
from tiny_models import TEXT_TOKEN_RANGE, build_model  # noqa: E402

LAYERS, HIDDEN = 8, 256  # 8 x 2 x 128 x 4 bytes: 8 KiB of target cache per prompt token


def main(spec: dict) -> dict:
    torch.set_num_threads(1)
    target = build_model("llama", num_layers=LAYERS, hidden_size=HIDDEN)
    torch.manual_seed(0)
    drafter = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(target, num_hidden_layers=1, block_size=4)).eval()
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(*TEXT_TOKEN_RANGE, (1, spec["prompt_tokens"]), generator=generator)
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False, max_new_tokens=12)
    if spec["method"] != "plain":
        kwargs.update(assistant_model=drafter, spec_strategy=spec["method"])
    record = measure_call(target, kwargs, "cpu", cold=spec["cold"])
    out = record.pop("output")
    return {**record, "tokens": out[0, input_ids.shape[1]:].tolist()}


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
