"""kvsp inside vLLM: the ``KVSPConnector`` KV connector and a vLLM-backed instance.

``connector`` and ``instance`` import vLLM (the ``kvsp[vllm]`` extra); ``layout`` and ``plans``
do not, so the conversions and the step planning are tested without it. vLLM finds the
connector by name through the ``vllm.general_plugins`` entry point (``plugin.register``).
"""

__all__: list[str] = []
