"""vLLM's attention backend interface over :class:`sjkvarn.vllm.paged.PagedJournal`.

The class stands in for vLLM's ``CPU_ATTN`` (the CPU platform always picks that name) and is
registered as ``CUSTOM``. With ``--attention-backend CUSTOM`` it packs each 128-token block
into SJ-KVaRN records; otherwise every method defers to vLLM's own CPU backend, so installing
sjkvarn changes nothing for engines that do not ask for it.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.v1.attention.backend import AttentionType, MultipleOf
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
)
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from sjkvarn.errors import InvalidInputError
from sjkvarn.vllm.paged import (
    BLOCK,
    WINDOW_MIN_BLOCK,
    PagedJournal,
    PagedSettings,
    WindowJournal,
    make_step,
    page_state_bytes,
    window_block_tokens,
    window_row_bytes,
)

# Under vLLM's logger, so that its handlers and format (and VLLM_LOGGING_LEVEL) apply.
logger = logging.getLogger("vllm.sjkvarn")

_HEAD_SIZES = (64, 128, 256, 512)


def settings_for(vllm_config: Any) -> PagedSettings | None:
    """sjkvarn's settings when the engine selected the ``CUSTOM`` backend, else None.

    Settings come from ``additional_config["sjkvarn"]``; that key without the ``CUSTOM``
    backend is a configuration vLLM would silently ignore, so it raises."""
    if vllm_config is None:
        return None
    extra = vllm_config.additional_config
    given = extra.get("sjkvarn") if isinstance(extra, dict) else None
    chosen = vllm_config.attention_config.backend == AttentionBackendEnum.CUSTOM
    if given is not None and not chosen:
        raise InvalidInputError(
            'additional_config["sjkvarn"] is set but the attention backend is not CUSTOM: '
            "pass --attention-backend CUSTOM (or attention_config={'backend': 'CUSTOM'})"
        )
    if not chosen:
        return None
    if given is not None and not isinstance(given, dict):
        raise InvalidInputError(
            f'additional_config["sjkvarn"] must be a mapping, got {type(given).__name__}'
        )
    return PagedSettings.from_dict(given)


# The settings of the sjkvarn engine in this process, remembered when its layers are built:
# vLLM asks some backend class methods (the page spec) under another (default) config.
_engine_settings: list[PagedSettings | None] = [None]
_logged = [False]


def _active() -> PagedSettings | None:
    settings = settings_for(get_current_vllm_config_or_none())
    if settings is not None:
        _engine_settings[0] = settings
    return _engine_settings[0]


def check_engine(vllm_config: Any) -> None:
    """Refuses engine settings the journal cannot honour, at startup."""
    cache = vllm_config.cache_config
    if cache.block_size is not None and cache.block_size != BLOCK:
        raise InvalidInputError(
            f"sjkvarn needs --block-size {BLOCK} (one block = one sealed record), "
            f"got {cache.block_size}"
        )
    if cache.cache_dtype not in ("auto", None):
        raise InvalidInputError(
            f"sjkvarn codes the KV cache itself: leave --kv-cache-dtype auto, got "
            f"{cache.cache_dtype!r}"
        )
    if str(vllm_config.device_config.device_type) != "cpu":
        raise InvalidInputError(
            "sjkvarn's vLLM backend runs on vLLM's CPU platform in this release "
            f"(device {vllm_config.device_config.device_type!r})"
        )


def _exact_window(settings: PagedSettings, spec: Any) -> bool:
    """Sliding-window layers keep exact rows (:class:`WindowJournal`) unless every page is
    lossless anyway."""
    return isinstance(spec, SlidingWindowSpec) and not settings.lossless


class SjkvarnAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend, or, when ``CUSTOM`` is selected, attention over SJ-KVaRN pages."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        settings = _active()
        if settings is None:
            return CPUAttentionBackend.get_supported_kernel_block_sizes(kv_cache_spec)
        if _exact_window(settings, kv_cache_spec):
            return [MultipleOf(WINDOW_MIN_BLOCK)]
        return [BLOCK]

    @classmethod
    def get_preferred_block_size(cls, default_block_size: int) -> int:
        if _active() is None:
            return super().get_preferred_block_size(default_block_size)
        return BLOCK

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        if _active() is None:
            return super().get_supported_head_sizes()
        return list(_HEAD_SIZES)

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        settings = _active()
        if settings is None:
            return super().customize_spec(spec)
        if spec.head_size not in _HEAD_SIZES or spec.head_size_v != spec.head_size:
            raise InvalidInputError(
                f"sjkvarn codes head sizes {_HEAD_SIZES} (K and V alike), got "
                f"{spec.head_size}/{spec.head_size_v}"
            )
        if _exact_window(settings, spec):
            # Exact fp16 rows, as many tokens per page as fit in a record page; the page is
            # padded to the record page so that both kinds of layer share one page size.
            rows = replace(spec, state_content_bytes=window_row_bytes(spec.head_size))
            if spec.block_size == 1:  # vLLM's per-token probe
                return rows
            record = spec.num_kv_heads * page_state_bytes(settings, spec.head_size, spec.dtype)
            return replace(
                rows,
                block_size=window_block_tokens(settings, spec.head_size),
                page_size_padded=record,
            )
        if spec.block_size < BLOCK:
            # vLLM's per-token probe: the journal has no per-token page, so it keeps vLLM's.
            return super().customize_spec(spec)
        state = page_state_bytes(settings, spec.head_size, spec.dtype)
        return replace(spec, tokens_per_state=BLOCK, state_content_bytes=state)

    @staticmethod
    def get_impl_cls() -> type[SjkvarnAttentionImpl]:
        return SjkvarnAttentionImpl


class SjkvarnAttentionImpl(CPUAttentionBackendImpl):
    """One attention layer: its :class:`PagedJournal` when sjkvarn is selected."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
        )
        self.journal: PagedJournal | WindowJournal | None = None
        vllm_config = get_current_vllm_config_or_none()
        settings = settings_for(vllm_config)
        # The engine whose layers are being built is the one the page-spec calls that follow
        # ask about: an engine without sjkvarn clears what an earlier one in this process set.
        _engine_settings[0] = settings
        if settings is None:
            return
        check_engine(vllm_config)
        refused = {
            "an attention type other than decoder": attn_type != AttentionType.DECODER,
            "ALiBi slopes": alibi_slopes is not None,
            "logit soft-capping": bool(logits_soft_cap),
            "attention sinks (s_aux)": sinks is not None,
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
        }
        for what, present in refused.items():
            if present:
                raise InvalidInputError(f"sjkvarn's vLLM backend does not support {what}")
        if head_size not in _HEAD_SIZES:
            raise InvalidInputError(f"sjkvarn codes head sizes {_HEAD_SIZES}, got {head_size}")
        if sliding_window and not settings.lossless:
            self.journal = WindowJournal(num_kv_heads, head_size, sliding_window)
        else:
            self.journal = PagedJournal(
                settings,
                num_kv_heads,
                head_size,
                vllm_config.model_config.dtype,
                sliding_window=sliding_window,
            )
        if not _logged[0]:
            _logged[0] = True
            dtype = vllm_config.model_config.dtype
            plain = 2 * BLOCK * head_size * torch.empty((), dtype=dtype).element_size()
            state = page_state_bytes(settings, head_size, dtype)
            logger.info(
                "sjkvarn: %s pages, %d bytes per KV head per block (%.2fx the model dtype's)%s",
                "lossless"
                if settings.lossless
                else f"{settings.body} {settings.k_bits}/{settings.v_bits}",
                state,
                plain / state,
                ""
                if settings.lossless
                else f"; sliding-window layers exact, "
                f"{window_block_tokens(settings, head_size)} fp16 rows per page",
            )

    def do_kv_cache_update(
        self,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        if self.journal is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        self.journal.write(kv_cache, key[:n], value[:n], slot_mapping)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.journal is None:
            return super().forward(
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale,
                output_block_scale,
            )
        if attn_metadata is None:  # warm-up
            return output
        if output_scale is not None or output_block_scale is not None:
            raise InvalidInputError("sjkvarn's vLLM backend has no fused output quantization")
        n = attn_metadata.num_actual_tokens
        step = step_for(attn_metadata, self.journal.step_block_size(kv_cache))
        result = self.journal.attend(
            kv_cache,
            query[:n].view(n, self.num_heads, self.head_size),
            None,
            None,
            None,
            self.scale,
            step=step,
        )
        output[:n].view(n, self.num_heads, self.head_size).copy_(result)
        self.journal.forget(step.live_sinks)
        return output


def step_for(attn_metadata: Any, block_size: int) -> Any:
    """The read plan of ``attn_metadata``'s engine step for pages of ``block_size`` tokens:
    built by the first layer that asks, kept on the metadata object (vLLM builds a new one each
    step, per KV-cache group) and shared by every later layer of the step."""
    steps = getattr(attn_metadata, "_sjkvarn_steps", None)
    if steps is None:
        steps = {}
        attn_metadata._sjkvarn_steps = steps
    step = steps.get(block_size)
    if step is None:
        reqs = attn_metadata.seq_lens.shape[0]
        step = make_step(
            attn_metadata.query_start_loc[: reqs + 1],
            attn_metadata.seq_lens,
            attn_metadata.block_table[:reqs],
            block_size,
        )
        steps[block_size] = step
    return step
