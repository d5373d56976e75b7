"""KernelConfig takes exact types: every integer field an int (numpy integers converted, bool and
floats refused), arch/dtype a str, causal a bool, so a bad type is a ConfigError naming the field
and never a crash deep in the build (issue 10, item 12)."""
import enum

import numpy as np
import pytest

from fa4gen.spec.config import ConfigError, KernelConfig

INT_FIELDS = {  # field -> a valid value
    "head_dim": 128, "gqa_ratio": 2, "block_m": 128, "block_n": 128, "q_stages": 2, "kv_stages": 3,
    "emu_pairs": 2, "emu_start": 1, "k_split": 96,
}


@pytest.mark.parametrize("field", sorted(INT_FIELDS))
@pytest.mark.parametrize("bad", [float, str, bool, lambda v: [v]], ids=["float", "str", "bool", "list"])
def test_integer_fields_refuse_non_integers(field, bad):
    value = bad(INT_FIELDS[field]) if bad is not bool else True
    with pytest.raises(ConfigError) as ei:
        KernelConfig(**{field: value})
    assert ei.value.field == field and "integer" in str(ei.value)


@pytest.mark.parametrize("field", sorted(INT_FIELDS))
@pytest.mark.parametrize("np_type", [np.int64, np.int32, np.uint8])
def test_numpy_integers_become_int(field, np_type):
    cfg = KernelConfig(**{field: np_type(INT_FIELDS[field])})
    value = getattr(cfg, field)
    assert type(value) is int and value == INT_FIELDS[field]
    assert cfg == KernelConfig(**{field: INT_FIELDS[field]})
    assert cfg.content_hash == KernelConfig(**{field: INT_FIELDS[field]}).content_hash


def test_the_reported_float_crashes_are_config_errors():
    for kw in ({"head_dim": 128.0}, {"gqa_ratio": 2.0}, {"block_m": 128.0}, {"head_dim": np.float64(64)}):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            KernelConfig(**kw)


class Arch(str, enum.Enum):
    SM90 = "sm_90a"


@pytest.mark.parametrize("field,value", [("arch", b"sm_90a"), ("arch", ["sm_90a"]), ("dtype", 16),
                                         ("dtype", None), ("causal", 1), ("causal", "yes")])
def test_string_and_bool_fields_refuse_other_types(field, value):
    with pytest.raises(ConfigError) as ei:
        KernelConfig(**{field: value})
    assert ei.value.field == field


def test_str_subclasses_become_plain_str():
    cfg = KernelConfig(arch=Arch.SM90, dtype=np.str_("fp16"), causal=np.bool_(True))
    assert type(cfg.arch) is str and cfg.arch == "sm_90a" and type(cfg.dtype) is str
    assert cfg.causal is True
    assert cfg.name == KernelConfig(arch="sm_90a", dtype="fp16", causal=True).name
    assert cfg.content_hash == KernelConfig(arch="sm_90a", dtype="fp16", causal=True).content_hash


def test_numpy_float_threshold_is_accepted():
    assert KernelConfig(rescale_threshold=np.float32(4.0)).rescale_threshold == 4.0
