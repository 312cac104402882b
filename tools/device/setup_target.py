"""Device machine: join the carried GGUF pieces, check the sha256, convert into the hf_adaptive_spec cache."""
import hashlib, json, sys, time
from pathlib import Path

from hf_adaptive_spec import models

entry = models.get_entry("smollm2-135m-instruct")
final = models.model_dir(entry)
if models.is_cached(entry):
    print("cached:", final); sys.exit(0)
A = Path("/tmp/keep/.gpua") if Path("/tmp/keep/.gpua/part0").is_file() else Path(".gpua")
parts = [A / "part0", Path(".gpub/part1"), Path(".gpub/part2")]
gguf = Path("/tmp/smollm2.gguf")
digest = hashlib.sha256()
with gguf.open("wb") as out:
    for part in parts:
        data = part.read_bytes(); digest.update(data); out.write(data)
assert digest.hexdigest() == entry.gguf_sha256, digest.hexdigest()
t0 = time.time()
build = final.parent / (final.name + ".build")
models.convert_gguf(gguf, build, dtype="float32", progress=False, entry=entry)
import gzip, shutil  # the tokenizer and configs as converted by transformers 5.23 on the developer machine
(build / "tokenizer.json").write_bytes(gzip.decompress((A / "tok/tokenizer.json.gz").read_bytes()))
for name in ("tokenizer_config.json", "chat_template.jinja", "config.json", "generation_config.json"):
    shutil.copy(A / "tok" / name, build / name)
marker = {"name": entry.name, "dtype": "float32", "format_version": models.FORMAT_VERSION,
          "gguf_sha256": entry.gguf_sha256, "requirements": list(entry.requirements), "seconds": round(time.time() - t0, 1),
          "note": "converted on the device machine from the carried GGUF"}
(build / models.MARKER).write_text(json.dumps(marker, indent=2))
build.rename(final)
print("converted", final, round(time.time() - t0, 1), "s")
