"""The OpenAI-compatible front end: a tenant's completions placed by the controller, streamed
from the chosen instance and carried across an instance failure."""

__all__: list[str] = []
