export PYTHONUNBUFFERED=1
mkdir -p /tmp/keep && cp -r .gpua /tmp/keep/ && ls -la /tmp/keep/.gpua
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD HF_ADAPTIVE_SPEC_DATA=$PWD/.gpuc/data
python3 .gpuc/smoke_model.py > $OUT/smoke.log 2>&1 && timeout 80 python3 .gpuc/train.py --target /tmp/tiny --budget 40 --max-prompts 256 --chunk 128 --generate-batch-size 128 --max-new-tokens 32 --eval-every 200 --out /tmp/tinyd --copy-to "" >> $OUT/smoke.log 2>&1; echo "smoke rc $?"
grep -v Warning $OUT/smoke.log | tail -12
