"""What a model class has been *verified* to support, and the refusal of anything else.

A flag is ``True`` only once a test or an example has run the model that way
(for ``supports_domain``: on domain-sharded ShardTensor inputs). An undeclared
model supports nothing beyond a single process, so a new model fails loudly
the first time someone tries to shard it instead of silently computing
something else.

A model class declares its capabilities in exactly one of two ways:

* a nested frozen dataclass named ``ModelCapabilities`` with bool fields
  (every instance of the class has the same profile)::

      class MyModel(nn.Module):
          @dataclass(frozen=True)
          class ModelCapabilities:
              supports_domain: bool = True
              supports_ddp: bool = True

* a classmethod ``get_capabilities(cls, config) -> ModelCapabilities`` when
  one class serves configurations with different profiles.

A class one cannot edit (a third-party model) gets its profile from outside,
with the same flags and the same refusal of unknown ones:

* :func:`register_capabilities` ``(ModelClass, supports_domain=True, ...)``
  for the whole process (subclasses inherit it, as they inherit a nested
  declaration), or
* ``parallelize_model(model, context, capabilities=...)`` for one call.

Either is refused for a class that declares its own profile: the class's
declaration is the one that was verified with it.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from .config import DDPConfig, FSDP2Config

__all__ = [
    "ModelCapabilities",
    "CapabilityError",
    "query_capabilities",
    "register_capabilities",
    "unregister_capabilities",
    "required_capabilities",
    "check_capabilities",
]


@dataclass(frozen=True)
class ModelCapabilities:
    """Declared parallelism capabilities of a model class (all ``False`` unless verified)."""

    #: runs on inputs that are ShardTensors split over the ``"domain"`` axis
    supports_domain: bool = False
    #: trains under ``DistributedDataParallel`` on the ``"ddp"`` axis
    supports_ddp: bool = False
    #: trains under FSDP2 ``fully_shard`` on the ``"ddp"`` axis
    supports_fsdp2: bool = False
    #: works under ``torch.compile`` (the parallelizer does not compile; training scripts read this)
    supports_compile: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise TypeError(f"ModelCapabilities.{f.name} must be a bool, got {getattr(self, f.name)!r}")


class CapabilityError(ValueError):
    """The model has not declared support for what the MeshContext asks of it."""


_FLAGS = tuple(f.name for f in dataclasses.fields(ModelCapabilities))


def _from_nested(cls: type, nested) -> ModelCapabilities:
    if not (inspect.isclass(nested) and dataclasses.is_dataclass(nested)):
        raise TypeError(f"{cls.__name__}.ModelCapabilities must be a (frozen) dataclass of bools")
    declared = {f.name: getattr(nested(), f.name) for f in dataclasses.fields(nested)}
    unknown = sorted(set(declared) - set(_FLAGS))
    if unknown:
        raise TypeError(f"{cls.__name__}.ModelCapabilities declares unknown flags {unknown}; known flags: {list(_FLAGS)}")
    return ModelCapabilities(**declared)


#: Profiles given from outside for classes one cannot edit (:func:`register_capabilities`), by class.
_REGISTERED: dict[type, ModelCapabilities] = {}


def _as_capabilities(value, owner: str) -> ModelCapabilities:
    """``value`` (a ModelCapabilities, or a mapping of flag names to bools) as a ModelCapabilities.

    Raises:
        TypeError: another type, an unknown flag (the known ones are listed) or a value that is not a bool.
    """
    if isinstance(value, ModelCapabilities):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"{owner} takes a ModelCapabilities or a mapping of flags to bools, got {type(value).__name__}")
    unknown = sorted(str(k) for k in set(value) - set(_FLAGS))
    if unknown:
        raise TypeError(f"{owner} got unknown flags {unknown}; known flags: {list(_FLAGS)}")
    return ModelCapabilities(**value)


def _refuse_if_declared(cls: type, how: str) -> None:
    nested, variant = _declaration(cls)
    if nested is not None or variant is not None:
        kind = "a nested ModelCapabilities" if nested is not None else "get_capabilities(cls, config)"
        raise TypeError(
            f"{cls.__name__} declares its own capabilities ({kind}); {how} is for classes that declare "
            "none. Change the declaration in the class, or subclass it with a declaration of your own"
        )


def register_capabilities(model_class: type, capabilities=None, /, **flags: bool) -> ModelCapabilities:
    """Declare the capabilities of a model class one cannot edit (a third-party model), for this process.

    Give either a :class:`ModelCapabilities` or the flags as keywords::

        register_capabilities(ThirdPartyNet, supports_domain=True, supports_ddp=True)

    Subclasses of ``model_class`` that declare nothing themselves inherit the
    profile. Registering a class again replaces its profile;
    :func:`unregister_capabilities` removes it. As with a nested declaration,
    set a flag only once the model has been verified that way.

    Returns:
        The registered :class:`ModelCapabilities`.

    Raises:
        TypeError: ``model_class`` is not a class, an unknown flag or a non-bool value, both a
            ModelCapabilities and keywords, or a class that declares its own capabilities.
    """
    if not inspect.isclass(model_class):
        raise TypeError(f"register_capabilities takes a model class, got {type(model_class).__name__}")
    if capabilities is not None and flags:
        raise TypeError("register_capabilities takes a ModelCapabilities or flags as keywords, not both")
    caps = _as_capabilities(flags if capabilities is None else capabilities, "register_capabilities")
    _refuse_if_declared(model_class, "register_capabilities")
    _REGISTERED[model_class] = caps
    return caps


def unregister_capabilities(model_class: type) -> None:
    """Forget the profile :func:`register_capabilities` gave ``model_class`` (nothing if it had none)."""
    _REGISTERED.pop(model_class, None)


def _registered(cls: type) -> ModelCapabilities | None:
    for klass in cls.__mro__:
        if klass in _REGISTERED:
            return _REGISTERED[klass]
    return None


def _declaration(cls: type):
    """The class's nested dataclass and its ``get_capabilities`` (either may be None; not both set)."""
    nested = getattr(cls, "ModelCapabilities", None)
    variant = getattr(cls, "get_capabilities", None)
    if nested is not None and variant is not None:
        raise TypeError(
            f"{cls.__name__} declares both a nested ModelCapabilities and get_capabilities(cls, config); "
            "keep exactly one (get_capabilities only when configurations differ)"
        )
    return nested, variant


def query_capabilities(target, config=None) -> ModelCapabilities:
    """The capabilities of a model instance, a model class, or a config object.

    * a model **instance**: its class's declaration; a variant class
      (``get_capabilities``) receives ``config`` if given, else the instance's
      ``config`` attribute;
    * a model **class**: its declaration; a variant class needs ``config``;
    * a **config** object: it names its model class in a ``model_class``
      attribute and is itself the config.

    A class that declares nothing gets the profile :func:`register_capabilities`
    gave it (or one of its bases), else ``ModelCapabilities()`` (all False).

    Raises:
        TypeError: both patterns declared, a malformed declaration, or a
            target that is none of the three.
        ValueError: a variant class without a config.
    """
    if inspect.isclass(target):
        cls, instance = target, None
    elif isinstance(target, nn.Module):
        cls, instance = type(target), target
    elif inspect.isclass(getattr(target, "model_class", None)):
        cls, instance, config = target.model_class, None, target if config is None else config
    else:
        raise TypeError(
            "query_capabilities takes a model instance, a model class, or a config object with a "
            f"`model_class` attribute; got {type(target).__name__}"
        )
    nested, variant = _declaration(cls)
    if nested is not None:
        return _from_nested(cls, nested)
    if variant is None:
        registered = _registered(cls)
        return ModelCapabilities() if registered is None else registered
    if config is None and instance is not None:
        config = getattr(instance, "config", None)
    if config is None:
        raise ValueError(
            f"{cls.__name__} declares get_capabilities(cls, config): its capabilities depend on the "
            "configuration, so pass a model instance, a config, or query_capabilities(cls, config)"
        )
    caps = variant(config)
    if not isinstance(caps, ModelCapabilities):
        raise TypeError(f"{cls.__name__}.get_capabilities must return a ModelCapabilities, got {type(caps).__name__}")
    return caps


def required_capabilities(mesh_context) -> tuple[str, ...]:
    """The flags a model needs for ``mesh_context``: the axes it uses and the strategy it asks for."""
    needed = []
    if mesh_context.domain_size > 1:
        needed.append("supports_domain")
    if isinstance(mesh_context.strategy, DDPConfig):
        needed.append("supports_ddp")
    if isinstance(mesh_context.strategy, FSDP2Config):
        needed.append("supports_fsdp2")
    return tuple(needed)


def check_capabilities(model, mesh_context, capabilities=None) -> None:
    """Raise :class:`CapabilityError` naming every flag ``model`` lacks for ``mesh_context``.

    ``capabilities`` (a ModelCapabilities or a mapping of flags), if given, stands
    for the declaration of a class that declares none (see :func:`register_capabilities`).
    """
    if capabilities is None:
        caps = query_capabilities(model)
    else:
        caps = _as_capabilities(capabilities, "capabilities=")
        _refuse_if_declared(type(model), "capabilities=")
    missing = [flag for flag in required_capabilities(mesh_context) if not getattr(caps, flag)]
    if missing:
        raise CapabilityError(
            f"{type(model).__name__} does not declare {', '.join(f'{m}=True' for m in missing)}, which this "
            f"MeshContext needs (ddp_size={mesh_context.ddp_size}, domain_size={mesh_context.domain_size}, "
            f"strategy={type(mesh_context.strategy).__name__ if mesh_context.strategy else None}). Verify the "
            "model that way, then declare it in a nested ModelCapabilities dataclass or get_capabilities, or, "
            "for a class you cannot edit, with register_capabilities(cls, ...) or parallelize_model(..., "
            "capabilities=...)"
        )
