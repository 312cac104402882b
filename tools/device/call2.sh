export PYTHONUNBUFFERED=1
T=${T:-500}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export HF_ADAPTIVE_SPEC_DATA=$PWD/.gpuc/data
if [ ! -f /tmp/keep/.gpua/part0 ] && [ ! -f .gpua/part0 ]; then
  echo "NO .gpua/part0: a fresh machine; kernel tests only"
  TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q tests/test_ops_triton.py -p no:cacheprovider > $OUT/triton_tests.log 2>&1; tail -4 $OUT/triton_tests.log
  exit 3
fi
python3 .gpuc/setup_target.py > $OUT/setup.log 2>&1 || { tail -20 $OUT/setup.log; exit 4; }
tail -1 $OUT/setup.log
python3 .gpuc/train.py --target smollm2-135m-instruct --budget $((T - SECONDS - 20)) --out /tmp/drafter --copy-to $OUT "$@" > $OUT/train.log 2>&1; echo "train rc $?"
grep -v Warning $OUT/train.log | tail -40
ls -la $OUT/drafter
