"""What a run is and where it runs, settled before any rank works: the options' checks,
the gradient's layout into pieces and shards, the MPI launch's environment (threads,
ranks per host) and each rank's GPU. The runtime's lowest wing: it imports no other."""
