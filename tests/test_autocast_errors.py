"""Bad input to the autocast API gets a clear error naming the valid choices."""

import jax.numpy as jnp
import pytest

import jaxamp


def test_unknown_device_type_names_the_choices():
  with pytest.raises(ValueError, match=r"`device_type` must be one of \('cpu', 'cuda'"):
    jaxamp.autocast(lambda x: x, device_type="tpu")


def test_non_string_device_type_is_a_type_error():
  with pytest.raises(TypeError, match="`device_type` must be a string"):
    jaxamp.autocast(lambda x: x, device_type=3)


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.float32, jnp.float64, "float8", object()])
def test_unsupported_dtype_names_the_choices(dtype):
  with pytest.raises(ValueError, match="`dtype` must be one of jnp.float16 or jnp.bfloat16"):
    jaxamp.autocast(lambda x: x, device_type="cuda", dtype=dtype)


def test_non_callable_is_a_type_error():
  with pytest.raises(TypeError, match="autocast transforms a callable"):
    jaxamp.autocast(3, device_type="cuda")


def test_non_bool_enabled_is_a_type_error():
  with pytest.raises(TypeError, match="`enabled` must be a bool"):
    jaxamp.autocast(lambda x: x, enabled="yes")


def test_get_autocast_dtype_of_unknown_device_type():
  with pytest.raises(ValueError, match="`device_type` must be one of"):
    jaxamp.get_autocast_dtype("mps")


def test_custom_fwd_rejects_a_non_float_cast():
  with pytest.raises(ValueError, match="`cast_inputs` must be one of"):
    jaxamp.custom_fwd(cast_inputs=jnp.int8)(lambda x: x)


def test_register_op_rejects_an_unknown_category():
  with pytest.raises(ValueError, match="`category` must be one of"):
    jaxamp.register_op("x", category="fp8")
