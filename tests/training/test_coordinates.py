"""cp_coordinates: a NamedTuple of this process's place in the (dp, cp) mesh."""

from __future__ import annotations

import pytest

from hf_blockdiag_cp.training import CPCoordinates, cp_coordinates


class _Mesh:
    """The three things cp_coordinates reads from a torch DeviceMesh (dp = 3, cp = 2, this rank = (2, 1))."""

    mesh_dim_names = ("dp", "cp")

    def get_local_rank(self, dim: str) -> int:
        return {"dp": 2, "cp": 1}[dim]

    def size(self, dim: int) -> int:
        return (3, 2)[dim]


def test_cp_coordinates_is_a_named_tuple():
    coords = cp_coordinates(_Mesh())
    assert isinstance(coords, CPCoordinates) and isinstance(coords, tuple)
    assert CPCoordinates._fields == ("dp_rank", "dp_size", "cp_rank", "cp_size")
    assert coords == (2, 3, 1, 2) and (coords.dp_rank, coords.dp_size, coords.cp_rank, coords.cp_size) == (2, 3, 1, 2)
    assert cp_coordinates(None) == CPCoordinates(dp_rank=0, dp_size=1, cp_rank=0, cp_size=1)
    with pytest.raises(TypeError):
        coords["cp_size"]  # no string keys any more


def test_cp_coordinates_refuses_other_meshes():
    mesh = _Mesh()
    mesh.mesh_dim_names = ("cp", "dp")
    with pytest.raises(ValueError, match=r"expected a \('dp', 'cp'\) mesh"):
        cp_coordinates(mesh)
