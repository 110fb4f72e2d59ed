"""One save/load protocol for what a task adds to a model: a part is a settings record and its tensors.

    save_part(folder, "early_exits", {"pooling": "mean"}, ramps.state_dict())
        -> folder/early_exits.json          the record, as JSON a person reads (peft's adapter_config.json)
           folder/early_exits.safetensors   the tensors, with the same record sealed into the file's metadata
    record, tensors = read_part(folder, "early_exits")   # the record checked against the sealed copy
    check_fits(folder, ramps, tensors, "its exits")      # every tensor present, of its shape, none extra

Early exits (``training.depth.EarlyExit``), the ScalarMix classifier (``training.recipes``) and task
modules (``training.adapters``: adapters, prefixes, LoRA, with their head) save and load through it, each
beside the plain checkpoint of the model it sits on (which transformers loads). Two files keep a format of
their own: ``training.lora.save_adapters`` (some of a model's tensors, in a file the caller names) and
sentence-transformers' folder settings (that library's format, ``compat.sentence``).
The record says how to rebuild the part (a class's ``config_keys``, as sentence-transformers' modules
say it); a record edited after saving, a tensor missing or of another shape is an InputError that names
the file and what differs -- nothing is loaded half-way.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import InputError

METADATA_KEY = "minibert_part"  # where the weights file keeps the record it was saved with


def files(name: str) -> tuple[str, str]:
    """The part's two file names: (``name``.json, ``name``.safetensors)."""
    return f"{name}.json", f"{name}.safetensors"


def write_part(folder, name: str, record: dict, tensors: dict) -> None:
    """``record`` and ``tensors`` into ``folder`` (which the caller writes atomically: ``textfiles.atomic_dir``),
    the record also sealed into the weights file's metadata."""
    from safetensors.torch import save_file

    from .loading import check_finite

    check_finite(dict(tensors), {}, f"{folder}: {name} not saved", saving=True)  # finite or nothing
    config_file, weights_file = files(name)
    (Path(folder) / config_file).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(Path(folder) / weights_file),
              metadata={METADATA_KEY: json.dumps(record, sort_keys=True)})


def save_part(folder, name: str, record: dict, tensors: dict) -> Path:
    """``write_part`` into ``folder`` atomically (a kill mid-write leaves the previous part whole)."""
    from .textfiles import atomic_dir

    with atomic_dir(folder, replaced=files(name)) as tmp:
        write_part(tmp, name, record, tensors)
    return Path(folder)


def has_part(folder, name: str) -> bool:
    return all((Path(folder) / f).is_file() for f in files(name))


def sealed_record(folder, name: str) -> dict | None:
    """The record the weights file was saved with (None when it has none)."""
    from safetensors import safe_open

    path = Path(folder) / files(name)[1]
    try:
        with safe_open(str(path), framework="pt") as f:
            text = (f.metadata() or {}).get(METADATA_KEY)
    except Exception as e:  # not a safetensors file, truncated
        raise InputError(f"{path.resolve()} cannot be read as safetensors ({type(e).__name__}: {e})") from None
    try:
        sealed = json.loads(text) if text is not None else None
    except ValueError:
        return None
    return sealed if isinstance(sealed, dict) else None


def check_record(folder, name: str, record: dict, keys=None) -> None:
    """The JSON record against the sealed one (``keys``: those compared; default all): a field edited after
    saving is an InputError naming it and both values."""
    sealed = sealed_record(folder, name)
    if sealed is None:
        return
    config_file, weights_file = files(name)
    for key in keys if keys is not None else sorted(set(record) | set(sealed)):
        said, saved = record.get(key), sealed.get(key)
        if said == saved:
            continue
        if isinstance(said, dict) and isinstance(saved, dict):
            fields = sorted(k for k in set(said) | set(saved) if said.get(k) != saved.get(k))
            what = "; ".join(f"{key}.{k} is {said.get(k)!r} there, {saved.get(k)!r} in {weights_file}" for k in fields)
        else:
            what = f"{key} is {said!r} there, {saved!r} in {weights_file}"
        raise InputError(f"{(Path(folder) / config_file).resolve()} does not say what its weights were saved with "
                         f"({what}): it was edited after saving; put back what {weights_file} records, or save it again")


def read_part(folder, name: str, *, what: str = "a saved part") -> tuple[dict, dict]:
    """(record, tensors) of part ``name`` in ``folder``, the record checked against the sealed copy."""
    from safetensors.torch import load_file

    from .textfiles import read_json

    config_file, weights_file = files(name)
    if not has_part(folder, name):
        raise InputError(f"{Path(folder).resolve()}: not {what} (needs {config_file} and {weights_file})")
    record = read_json(Path(folder) / config_file)
    if not isinstance(record, dict):
        raise InputError(f"{(Path(folder) / config_file).resolve()}: a JSON object was expected")
    check_record(folder, name, record)
    return record, load_file(str(Path(folder) / weights_file))


def check_fits(folder, module, state: dict, what: str) -> None:
    """Every saved tensor is one ``module`` has, of the same shape, and none is missing: an InputError naming
    each tensor that does not fit and both shapes."""
    own = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    saved = {k: tuple(v.shape) for k, v in state.items()}
    problems = [f"{k}: saved {saved[k]}, this model needs {own[k]}" for k in sorted(set(own) & set(saved))
                if own[k] != saved[k]]
    problems += [f"{k}: missing from the file (this model needs {own[k]})" for k in sorted(set(own) - set(saved))]
    problems += [f"{k}: in the file {saved[k]}, not a tensor of this model" for k in sorted(set(saved) - set(own))]
    if problems:
        shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
        raise InputError(f"{Path(folder).resolve()}: {what} does not fit ({shown})")
