"""A run from the command line or a script: ``mpigrad train``'s options and entry point
(:mod:`.launch`), each rank's session from start-up to its last message (:mod:`.session`),
``mpigrad train``'s own training loop (:mod:`.recipe`), a script's (:mod:`.script`) and
``mpigrad doctor``. The runtime's top wing."""
