"""``MixtralConfig``: the hyper-parameters of ``aristax.models.Mixtral``, named as in
Hugging Face's config.json (its own module so that ``hf`` reads configs without
importing the model). Validation and the config.json mapping are
``aristax.models.decoder_config.DecoderConfig``'s."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from aristax.models.decoder_config import DecoderConfig


@dataclasses.dataclass(frozen=True)
class MixtralConfig(DecoderConfig):
    """Hyper-parameters of a Mixtral decoder, named as in Hugging Face's config.json
    (the shared fields are documented on ``DecoderConfig``, whose defaults are
    Mixtral's).

    ``num_local_experts`` E experts of width ``intermediate_size`` in every layer,
    routing weights renormalised over the top K. ``router_jitter_noise`` eps > 0:
    in training the MoE block's input is multiplied by U(1 - eps, 1 + eps) noise (HF
    ``MixtralSparseMoeBlock``).
    """

    display_name: ClassVar[str] = "Mixtral"
    model_type: ClassVar[str] = "mixtral"
    architecture: ClassVar[str] = "MixtralForCausalLM"
    experts_field: ClassVar[str] = "num_local_experts"
    hf_aliases: ClassVar[dict[str, str]] = {"num_experts": "num_local_experts"}

    num_local_experts: int = 8
    router_jitter_noise: float = 0.0

    @property
    def moe_input_jitter(self) -> float:
        return self.router_jitter_noise

    def _check_family(self) -> None:
        if not 0 <= self.router_jitter_noise < 1:
            raise self._bad("router_jitter_noise", self.router_jitter_noise, "must be in [0, 1)")
