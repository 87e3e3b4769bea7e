"""A checkpoint's decoding defaults: Hugging Face's ``generation_config.json``.

Hugging Face ``generate`` takes its EOS and pad ids and its sampling settings from
``model.generation_config``: read from ``generation_config.json`` where the checkpoint
has one (instruct checkpoints list extra EOS ids there only, and some ask to sample),
else made from ``config.json``. ``aristax.models.generate`` resolves its arguments
the same way, from ``DecoderLM.generation_config``.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

FILE = "generation_config.json"  # beside config.json

# Keys HF generate applies that aristax does not, with the value that does nothing.
NOT_APPLIED = {
    "num_beams": 1, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "min_length": 0, "min_new_tokens": None, "min_p": None, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "bad_words_ids": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "encoder_repetition_penalty": 1.0,
    "penalty_alpha": None, "guidance_scale": None, "num_return_sequences": 1,
    "sequence_bias": None, "exponential_decay_length_penalty": None, "top_h": None,
    "stop_strings": None, "max_time": None, "watermarking_config": None,
}


_KINDS = {"do_sample": bool, "temperature": float, "top_k": int, "top_p": float,
          "pad_token_id": int}


def _typed(key: str, value, kind: type, source: str):
    """``value`` (of ``key``) as ``kind`` (an int is a float; a bool is neither), else a
    ValueError naming the key and the file."""
    numbers = (int, float) if kind is float else (kind,)
    if not isinstance(value, numbers) or (kind is not bool and isinstance(value, bool)):
        what = {bool: "boolean", int: "integer", float: "number"}[kind]
        raise ValueError(f"{source}: {key}={value!r} must be a JSON {what}")
    return kind(value)


def _ids(value) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(int(v) for v in (value if isinstance(value, (list, tuple)) else [value]))


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """The settings of HF's ``GenerationConfig`` that ``generate`` applies, with HF's
    defaults (greedy; when sampling, top-k 50 then top-p 1.0).

    Attributes:
      do_sample: sample (at ``temperature``) instead of taking the argmax.
      temperature, top_k, top_p: the sampling warpers, applied in that order (top_k 0:
        off).
      eos_token_id: ids that end a row (None: the model config's).
      pad_token_id: emitted by ended rows (None: the model config's, else the first
        EOS id).
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 50
    top_p: float = 1.0
    eos_token_id: tuple[int, ...] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: dict[str, Any], *, source: str = FILE) -> GenerationConfig:
        """From a generation_config.json object; keys HF generate would apply and
        aristax does not (``NOT_APPLIED``, set to another value) are named in a
        warning. ``null`` sampling values take HF's defaults."""
        ignored = {k: hf[k] for k, neutral in NOT_APPLIED.items()
                   if k in hf and hf[k] != neutral}
        if ignored:
            warnings.warn(f"{source} sets {ignored}, which aristax generate does not apply",
                          UserWarning, stacklevel=2)
        values = {k: _typed(k, hf[k], kind, source) for k, kind in _KINDS.items()
                  if hf.get(k) is not None}
        eos = hf.get("eos_token_id")
        if eos is not None:
            eos = tuple(_typed("eos_token_id", e, int, source)
                        for e in (eos if isinstance(eos, list) else [eos]))
        return cls(**values, eos_token_id=eos)

    @classmethod
    def from_model_config(cls, config) -> GenerationConfig:
        """HF's ``GenerationConfig.from_model_config``: the special ids of config.json."""
        return cls(eos_token_id=_ids(config.eos_token_id), pad_token_id=config.pad_token_id)

    def to_hf(self) -> dict[str, Any]:
        """The generation_config.json object (HF's defaults left out, as HF writes it)."""
        default = GenerationConfig()
        out = {k: v for k, v in dataclasses.asdict(self).items()
               if v != getattr(default, k)}
        if self.eos_token_id is not None:
            eos = list(self.eos_token_id)
            out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
        return out

