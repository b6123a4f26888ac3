"""Each service's settings, from four places in this order of precedence: its command-line
flags, ``KVSP_<SERVICE>_<SETTING>`` environment variables, the ``[<service>]`` table of a
TOML file (``--config FILE``, or ``KVSP_CONFIG``), then the defaults.

A service's settings model (``SERVICES[name]``, a pydantic-settings model) is made from its
command's signature (``settings_command``): each flag is one setting, with the flag's type,
default, bounds and help, so a default is written once. The command line then takes every
flag as optional; the model says what is required and checks every value, wherever it came
from, and the command runs with the merged values.

Secrets: a token is read from its file (``--index-token-file``, ...) or given whole in the
environment (``KVSP_HOLDER_INDEX_TOKEN``), never on the command line or in a config file.
``kvsp config check FILE`` prints every service's effective settings in FILE (environment
applied) with secrets masked.
"""

from __future__ import annotations

import copy
import functools
import inspect
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar

import typer
from pydantic import Field, SecretStr, ValidationError, create_model
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from kvsp.core.problems import ConfigurationError

__all__ = ["SERVICES", "ServiceSettings", "check_file", "settings_command"]

#: the settings model of each service, by its table name in a config file
SERVICES: dict[str, type[ServiceSettings]] = {}
#: a ``*_token_file`` setting's token may instead be given whole in the environment
_TOKEN_FILE = "_token_file"  # noqa: S105 - a name suffix, not a secret


class ServiceSettings(BaseSettings):
    """One service's settings; ``load`` merges the four sources in their order."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True, env_ignore_empty=True)
    section: ClassVar[str] = ""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: Any,
        env_settings: Any,
        dotenv_settings: Any,
        file_secret_settings: Any,
    ) -> tuple[Any, ...]:
        return (init_settings,)  # ``load`` orders the sources itself

    @classmethod
    def env_prefix(cls) -> str:
        return f"KVSP_{cls.section.upper()}_"

    @classmethod
    def load(cls, path: Path | None, flags: Mapping[str, Any]) -> ServiceSettings:
        """The settings from ``flags``, the environment, ``path``'s table, the defaults."""
        from_file = _table(path, cls.section) if path is not None else {}
        fields = cls.model_fields
        secrets = sorted(
            n for n in from_file if n in fields and fields[n].annotation == SecretStr | None
        )
        if secrets:
            raise ConfigurationError(
                f"{secrets} are secrets: give them in the environment or in their files, "
                "never in a config file"
            )
        from_env = EnvSettingsSource(cls, env_prefix=cls.env_prefix())()
        try:
            return cls(**{**from_file, **from_env, **flags})
        except ValidationError as exc:
            raise ConfigurationError(_explain(cls, exc)) from None

    def arguments(self) -> dict[str, Any]:
        """The values to run the command with: a token given in the environment stands in
        for its file's setting (the command reads either)."""
        values = {name: getattr(self, name) for name in type(self).model_fields}
        for name in [n for n in values if n.endswith("_token") and n + "_file" in values]:
            token = values.pop(name)
            if token is not None and values[name + "_file"] is None:
                values[name + "_file"] = token
        return values

    def masked(self) -> dict[str, Any]:
        """The settings as JSON values, secrets masked."""
        return self.model_dump(mode="json")


def _table(path: Path, section: str) -> dict[str, Any]:
    try:
        doc = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigurationError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigurationError(f"config file {path}: {exc}") from None
    table = doc.get(section, {})
    if not isinstance(table, dict):
        raise ConfigurationError(f"config file {path}: [{section}] must be a table")
    return table


def _explain(model: type[ServiceSettings], exc: ValidationError) -> str:
    """One line per invalid setting, named as a flag and as its environment variable."""
    lines = []
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else "?"
        flag = "--" + name.replace("_", "-")
        lines.append(f"{flag} ({model.env_prefix()}{name.upper()}, {model.section}.{name}): "
                     f"{error['msg']}")  # fmt: skip
    return "invalid settings: " + "; ".join(lines)


def check_file(path: Path) -> dict[str, dict[str, Any]]:
    """Every service's effective settings in ``path`` (its environment applied), masked;
    ``ConfigurationError`` for an unknown table or an invalid setting."""
    doc = tomllib.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    if doc is None:
        raise ConfigurationError(f"no config file {path}")
    unknown = sorted(set(doc) - set(SERVICES))
    if unknown:
        raise ConfigurationError(f"config file {path}: unknown tables {unknown}; "
                                 f"known: {sorted(SERVICES)}")  # fmt: skip
    return {name: SERVICES[name].load(path, {}).masked() for name in doc}


def _base(annotation: Any) -> Any:
    """``T`` of ``T | None``."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def settings_command(section: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Make ``fn``'s flags the settings of service ``section`` (a model in ``SERVICES``), and
    ``fn`` a command that also takes ``--config FILE`` and the environment."""

    def wrap(fn: Callable[..., None]) -> Callable[..., None]:
        hints = typing.get_type_hints(fn, include_extras=True)
        fields: dict[str, Any] = {}
        params = [
            inspect.Parameter(
                "config", inspect.Parameter.KEYWORD_ONLY, default=None,
                annotation=Annotated[Path | None, typer.Option(
                    "--config", envvar="KVSP_CONFIG",
                    help=f"settings file (TOML): its [{section}] table")],
            )
        ]  # fmt: skip
        prefix = f"KVSP_{section.upper()}_"
        for p in inspect.signature(fn).parameters.values():
            kind, shared = typing.get_args(hints[p.name])[:2]
            option = copy.copy(shared)  # aliases (--http-limit, ...) serve several commands
            required = p.default is inspect.Parameter.empty
            bounds = {k: v for k, v in (("ge", option.min), ("le", option.max)) if v is not None}
            default = ... if required else p.default
            fields[p.name] = (kind, Field(default, description=option.help, **bounds))
            if p.name.endswith(_TOKEN_FILE):
                fields[p.name.removesuffix("_file")] = (SecretStr | None, None)
            said = "required" if required else f"default {p.default!r}"
            option.help = f"{option.help or ''} ({said}; env {prefix}{p.name.upper()})".strip()
            option.show_default = False
            decls = list(option.param_decls)
            if _base(kind) is bool and not any("/" in d for d in decls):
                option.param_decls = tuple(f"{d}/--no-{d.removeprefix('--')}" for d in decls)
            params.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=Annotated[_base(kind) | None, option]))  # fmt: skip
        model = create_model(f"{section.title()}Settings", __base__=ServiceSettings, **fields)
        model.section = section
        SERVICES[section] = model

        @functools.wraps(fn)
        def command(**given: Any) -> None:
            config = given.pop("config")
            flags = {k: v for k, v in given.items() if v is not None and v != []}
            fn(**model.load(config, flags).arguments())

        command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        del command.__wrapped__  # typer reads the signature above, not fn's
        return command

    return wrap
