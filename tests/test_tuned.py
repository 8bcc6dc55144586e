"""The defaults table (`dsa_jax/pallas/tuned.py`) is what the ops' "auto" backends run."""

import jax
import jax.numpy as jnp
import pytest

from dsa_jax.pallas import pool_scores as ps
from dsa_jax.pallas import pool_topk as pt
from dsa_jax.pallas import sparse_attend as sa
from dsa_jax.pallas import tuned

FP8 = jnp.float8_e4m3fn


def _gpu(monkeypatch, cc: str) -> None:
    dev = type("Dev", (), {"platform": "gpu", "compute_capability": cc})()
    monkeypatch.setattr(jax, "devices", lambda *a: [dev])


def test_the_table_covers_every_device_and_shape_class():
    for device in ("hopper", "gpu", "interpret"):
        for shape in ("rows", "many_rows"):
            b = tuned.DEFAULTS[device, shape]
            assert b.attend in ("mosaic", "triton") and b.scores in ("mosaic", "triton")
            assert b.topk in ("pallas", "triton")
    # Mosaic GPU kernels compile for Hopper only and have no interpret mode; the raw Triton
    # top-k has no interpret mode either.
    for shape in ("rows", "many_rows"):
        assert tuned.DEFAULTS["interpret", shape] == tuned.Backends("triton", "triton", "pallas")
        assert "mosaic" not in (tuned.DEFAULTS["gpu", shape].attend,
                                tuned.DEFAULTS["gpu", shape].scores)


def test_shape_classes():
    assert tuned.shape_class(tuned.MANY_ROWS - 1) == "rows"
    assert tuned.shape_class(tuned.MANY_ROWS) == "many_rows"
    assert pt.AUTO_TRITON_MIN_ROWS == tuned.MANY_ROWS


@pytest.mark.parametrize("device,cc", [("hopper", "9.0"), ("gpu", "8.0")])
def test_auto_backends_follow_the_table(monkeypatch, device, cc):
    """Each op's "auto" rule picks the table's kernel wherever that kernel supports the
    shapes (GLM-5.3-Flash's: fp8 cache, C 512, 64 heads; Hi 32, Di 128)."""
    _gpu(monkeypatch, cc)
    assert tuned.device_class(False) == device
    for rows in (1, tuned.MANY_ROWS):
        want = tuned.DEFAULTS[device, tuned.shape_class(rows)]
        assert sa.pick_backend(sa.AttendTuning(), FP8, 64, 512, False, False) == want.attend
        assert ps.pick_backend(ps.PoolScoresTuning(), 32, 128, False) == want.scores
        assert pt.runs_triton(pt.PoolTopkTuning(), rows, False) == (want.topk == "triton")
    # interpret mode: the Triton kernels and the Pallas top-k, whatever the device
    assert sa.pick_backend(sa.AttendTuning(), FP8, 64, 512, True, False) == "triton"
    assert ps.pick_backend(ps.PoolScoresTuning(), 32, 128, True) == "triton"
    assert not pt.runs_triton(pt.PoolTopkTuning(), tuned.MANY_ROWS, True)


def test_the_mosaic_attend_runs_only_where_it_supports_the_shapes(monkeypatch):
    _gpu(monkeypatch, "9.0")
    auto = sa.AttendTuning()
    assert sa.pick_backend(auto, jnp.bfloat16, 64, 512, False, False) == "triton"  # not fp8
    assert sa.pick_backend(auto, FP8, 8, 512, False, False) == "triton"  # 8 of 64 tile rows
    assert sa.pick_backend(auto, FP8, 32, 512, False, False) == "mosaic"  # half a tile
