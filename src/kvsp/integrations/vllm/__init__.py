"""kvsp inside vLLM: the ``KVSPConnector`` KV connector and a vLLM-backed instance.

``connector``, ``instance``, ``events``, ``hints`` and ``sampling`` import vLLM (the
``kvsp[vllm]`` extra); ``layout``, ``plans`` and ``g1`` do not, so the conversions, the step
planning and the page table are tested without it. vLLM finds the
connector by name through the ``vllm.general_plugins`` entry point (``plugin.register``).
"""

__all__: list[str] = []
