"""A network lab in the box: real rate-limited links on one machine (``mpigrad lab``, docs/lab.rst).

Imports neither torch nor mpi4py: modules :mod:`.host` (checks, commands), :mod:`.netns`
(namespaces), :mod:`.shaping` (tbf, events), :mod:`.ratecheck` (+ :mod:`.probe`),
:mod:`.launch` (running a command one rank per node) and :mod:`.cli`.
"""
