"""sjkvarn inside vLLM: the SJ-KVaRN journal as vLLM's KV cache (``pip install "sjkvarn[vllm]"``).

Select it the vLLM way, with the ``CUSTOM`` attention backend, and pass sjkvarn's settings
through vLLM's ``additional_config`` (all optional; :class:`~sjkvarn.vllm.paged.PagedSettings`)::

    vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --block-size 128 \\
        --attention-backend CUSTOM --additional-config '{"sjkvarn": {"k_bits": 4, "v_bits": 4}}'

    LLM(model=..., block_size=128, attention_config={"backend": "CUSTOM"},
        additional_config={"sjkvarn": {"k_bits": 4, "v_bits": 4}})

Each 128-token vLLM block is one sealed SJ-KVaRN body group: vLLM allocates pages of the
compressed record size, so the same KV memory holds 3.5x (bf16) to 7x (fp32) more blocks at
4/4 bits. vLLM finds this plugin through its ``vllm.general_plugins`` entry point; nothing in
vLLM is patched. Without ``--attention-backend CUSTOM`` vLLM runs exactly as before.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("sjkvarn.vllm")

PLUGIN_NAME = "sjkvarn"


def register() -> None:
    """vLLM plugin entry point (``vllm.general_plugins``): registers sjkvarn's backend as
    ``CUSTOM`` and, on the CPU platform (which always picks ``CPU_ATTN``), in ``CPU_ATTN``'s
    place; the backend behaves as vLLM's own CPU backend unless ``CUSTOM`` was selected."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    path = "sjkvarn.vllm.backend.SjkvarnAttentionBackend"
    register_backend(AttentionBackendEnum.CUSTOM, path)
    register_backend(AttentionBackendEnum.CPU_ATTN, path)
    logger.debug("sjkvarn vLLM backend registered (%s)", path)
