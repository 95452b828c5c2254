"""mpigrad: communication-efficient data-parallel training over MPI."""

__version__ = "0.1.0"
