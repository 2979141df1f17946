"""The config's lists of variant names agree with the registries that build them.

`tformer.config` sits below `layers` and `models` in the import chain, so it keeps its own name tuples for
validation and error messages; this test keeps them in step with the registries (a name in one and not the other
would be accepted by the config and then fail to build, or exist and be refused).
"""

from __future__ import annotations

import pytest

from tformer import config
from tformer.layers.attention import ATTENTION_BACKENDS
from tformer.layers.block import RESIDUALS, SELF_ATTENTIONS
from tformer.layers.ffn import ACTIVATIONS, FFNS, ROUTERS
from tformer.layers.norms import NORMS
from tformer.layers.positions import POSITIONS, SINUSOIDAL_LAYOUTS
from tformer.models.families import ENCODER_HEADS, MODELS
from tformer.models.init import INITS

PAIRS = {
    "FAMILIES": MODELS,
    "POSITION_NAMES": POSITIONS,
    "SINUSOIDAL_LAYOUT_NAMES": SINUSOIDAL_LAYOUTS,
    "FFN_NAMES": FFNS,
    "NORM_NAMES": NORMS,
    "NORM_PLACEMENTS": RESIDUALS,
    "ATTENTION_BACKEND_NAMES": ATTENTION_BACKENDS,
    "ATTENTION_NAMES": SELF_ATTENTIONS,
    "INIT_NAMES": INITS,
    "ENCODER_HEAD_NAMES": ENCODER_HEADS,
    "MOE_ROUTER_NAMES": ROUTERS,
}


@pytest.mark.parametrize("names", PAIRS)
def test_config_names_are_the_registry_keys(names: str) -> None:
    assert sorted(getattr(config, names)) == sorted(PAIRS[names])


def test_every_ffn_has_its_activation() -> None:
    assert sorted(ACTIVATIONS) == sorted(config.FFN_NAMES)


def test_every_config_name_tuple_is_checked_here() -> None:
    """A new *_NAMES tuple in config.py must get its registry above (ROPE_SCALINGS are branches, not a registry)."""
    tuples = {
        name
        for name, value in vars(config).items()
        if name.isupper() and isinstance(value, tuple) and all(isinstance(v, str) for v in value)
    }
    assert tuples - set(PAIRS) == {"ROPE_SCALINGS"}
