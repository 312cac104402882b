"""One rank of the tensor-parallel check in `test_split_targets.py` (run by torchrun, 2 processes, gloo on CPU).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp_worker.py TARGET DRAFTER OUT_JSON

TARGET and DRAFTER are tiny Llamas saved with `save_pretrained`. Every rank loads the target sharded by
transformers' tensor parallelism (`DistributedConfig(tp_plan="auto")`) and a reference copy unsharded, and runs
plain greedy and speculative generate (chain, static_tree, sage, laspec; an unsharded drafter, and the drafter
sharded too for sage) on the same inputs; sampling runs check that both ranks emit the same tokens.
Rank 0 writes OUT_JSON: {"exact": {case: true | error}, "ranks_agree": {case: bool}, "pruned": int (draft nodes
the cost rule trimmed: it is off under tensor parallelism)}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_adaptive_spec  # noqa: E402,F401  (installs the generate() hook)
from hf_adaptive_spec import LaSpecDrafterConfig, LaSpecDrafterModel  # noqa: E402
from tiny_models import make_inputs  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.distributed import DistributedConfig  # noqa: E402

MAX_NEW = 16


def _load(path, sharded: bool):
    extra = {"distributed_config": DistributedConfig(tp_plan="auto")} if sharded else {}
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa", **extra).eval()


def _gather(value):
    values = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(values, value)
    return values


def main(target_path: str, drafter_path: str, out_path: str) -> None:
    torch.set_num_threads(1)
    target = _load(target_path, sharded=True)  # initializes the process group (torchrun's environment)
    rank = torch.distributed.get_rank()
    reference = _load(target_path, sharded=False)
    drafter = _load(drafter_path, sharded=False)
    sharded_drafter = _load(drafter_path, sharded=True)
    torch.manual_seed(0)
    laspec = LaSpecDrafterModel(LaSpecDrafterConfig.for_target(reference, block_size=4)).eval()
    exact, agree, pruned = {}, {}, 0
    runs = [(name, drafter) for name in ("chain", "static_tree", "sage")] + [("laspec", laspec)]
    runs += [("sage+sharded_drafter", sharded_drafter)]
    for batch in (1, 2):
        inputs = make_inputs("llama", batch_size=batch)
        expected = reference.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
        exact[f"plain/batch{batch}"] = bool(torch.equal(target.generate(**inputs, max_new_tokens=MAX_NEW,
                                                                         do_sample=False), expected))
        for name, assistant in runs:
            case = f"{name}/batch{batch}"
            try:
                out = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, assistant_model=assistant,
                                      spec_strategy=name.split("+")[0], return_dict_in_generate=True)
                exact[case] = bool(torch.equal(out.sequences, expected))
                pruned += out.spec_stats.pruned_tokens
            except Exception as error:  # noqa: BLE001 - reported in the JSON
                exact[case] = f"{type(error).__name__}: {error}\n{traceback.format_exc()[-2000:]}"
        for name, assistant in (runs[0], runs[2], runs[3]) if batch == 2 else ():  # sampling: same draws on every rank
            torch.manual_seed(1234)
            out = target.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=True, temperature=0.8,
                                  assistant_model=assistant, spec_strategy=name)
            agree[f"{name}/sample/batch{batch}"] = len({tuple(o.flatten().tolist()) for o in _gather(out)}) == 1

    if rank == 0:
        with open(out_path, "w") as handle:
            json.dump({"exact": exact, "ranks_agree": agree, "pruned": pruned}, handle, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
