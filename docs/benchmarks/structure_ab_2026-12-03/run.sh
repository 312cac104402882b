#!/bin/bash
# The code before the structure changes (commit 229d057, checked out in /tmp/work/old) against the code after
# (the installed package), one after the other on the same machine.
cd /tmp
SMOL="bench --target smollm2-135m-instruct --drafter laspec-smollm2-135m-instruct --no-stock --limit 4 --strategies laspec --max-new-tokens 128 --threads 2 --no-progress --no-plots"
QWEN="bench --target qwen2.5-coder-1.5b-instruct --drafter qwen2.5-coder-0.5b-instruct --drafter-int8 --no-stock --limit 1 --strategies sage --max-new-tokens 64 --threads 2 --no-progress --no-plots"
PYTHONPATH=/tmp/work/old python -m hf_adaptive_spec.cli $SMOL --out /tmp/work/ab/old_smol_1 > /tmp/work/ab/old_smol_1.log 2>&1
python -m hf_adaptive_spec.cli $SMOL --out /tmp/work/ab/new_smol_1 > /tmp/work/ab/new_smol_1.log 2>&1
python -m hf_adaptive_spec.cli $QWEN --out /tmp/work/ab/new_qwen_1 > /tmp/work/ab/new_qwen_1.log 2>&1
PYTHONPATH=/tmp/work/old python -m hf_adaptive_spec.cli $QWEN --out /tmp/work/ab/old_qwen_1 > /tmp/work/ab/old_qwen_1.log 2>&1
echo AB DONE
