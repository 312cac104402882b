#!/bin/bash
# The seam change before / after: /tmp/before is a worktree at 87f9f38, /tmp/after54 one at c285864; each tree's
# package is put first on PYTHONPATH. Static concurrency sweep, then the served grid, one torch thread each.
set -x
OUT=/tmp/ab54
mkdir -p $OUT
for tree in before after54; do
  PYTHONPATH=/tmp/$tree python -c "import sys; from hf_adaptive_spec.cli import main; sys.exit(main())" bench \
    --target smollm2-135m-instruct --drafter laspec-smollm2-135m-instruct \
    --load-sweep 1 4 --datasets mtbench --limit 6 --max-new-tokens 40 --threads 1 --fixed chain2 --strategies laspec sage \
    --no-plots --out $OUT/static_$tree > $OUT/static_$tree.log 2>&1
done
for tree in before after54; do
  PYTHONPATH=/tmp/$tree python -c "import sys; from hf_adaptive_spec.cli import main; sys.exit(main())" bench-served \
    --target smollm2-135m-instruct --drafter laspec-smollm2-135m-instruct \
    --arrivals poisson --rates 1 4 --fixed --requests 12 --max-new-tokens 40 --max-batch 8 --threads 1 --no-prepare \
    --out $OUT/served_$tree > $OUT/served_$tree.log 2>&1
done
