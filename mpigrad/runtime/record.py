"""IterationRecord: what one iteration did, as ``ParameterServer.step`` returns it.

Tracing (:mod:`.tracing`) and the progress line consume records; neither reads the
server's internals. Times are seconds; ``t_*`` are per-iteration durations on the clock
the run charges (CPU time of one-thread ranks, see :mod:`.clock`), ``wall_time`` and
``sim_time`` are cumulative.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IterationRecord:
    iteration: int
    loss: float                     # mean of the workers' losses
    bits: list[int]                 # bits per quantized layer, as the codec used them
    bytes_up: int                   # worker -> server bytes, every worker and server together
    bytes_down: int                 # server -> rank bytes, every broadcast copy together
    t_compute: float                # slowest worker's forward + backward
    t_encode: float                 # slowest worker's encode + slowest server's re-encode
    t_decode: float                 # slowest server's decode (rank 0's includes the broadcasts)
    t_policy: float                 # rank 0's bit decision
    t_comm: float                   # modelled (or, with --net-mode off, measured) communication
    wall_time: float
    sim_time: float
    worker_losses: list[float]
    worker_compute: list[float]
    worker_bytes: list[int]         # each worker's frames, all servers together
    server_bytes_in: list[int]      # per server: the frames it received
    server_bytes_out: list[int]     # per server: its broadcast frame (one copy, length included)
    server_t_decode: list[float]
    server_t_encode: list[float]
    norm_ratio: list[float]         # ||Q(g)|| / ||g|| per quantized layer (g the workers' average)
    checksums: list[int] | None = None          # every rank's parameter CRC, on checksum iterations
    policy_rows: list[dict] = field(default_factory=list)

    def steps_row(self) -> dict:
        bits = self.bits
        return dict(iteration=self.iteration, wall_time=self.wall_time, sim_time=self.sim_time,
                    loss=self.loss, bits=bits[0], bits_layers=bits, norm_ratio=self.norm_ratio, bytes_up=self.bytes_up,
                    bytes_down=self.bytes_down, t_compute=self.t_compute, t_encode=self.t_encode,
                    t_decode=self.t_decode, t_comm=self.t_comm, t_policy=self.t_policy)

    def workers_row(self) -> dict:
        return dict(iteration=self.iteration, loss=self.worker_losses, t_compute=self.worker_compute,
                    bytes_sent=self.worker_bytes)

    def servers_row(self) -> dict:
        return dict(iteration=self.iteration, bytes_in=self.server_bytes_in,
                    bytes_out=self.server_bytes_out, t_decode=self.server_t_decode,
                    t_encode=self.server_t_encode)
