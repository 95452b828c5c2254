"""The wire: every message's layout (:mod:`.messages`) and the channel ranks talk through
(:mod:`.channel`; MPI in :mod:`.mpi`, in-process loopback in :mod:`.loopback`).
This package imports no MPI: only :mod:`.mpi` does."""

from .channel import WORLD, Channel, PeerFailed, PeerTimeout, ReceiveBuffers
from .messages import (CHECKPOINT_AFTER, CONTINUE, STATUS_NONFINITE_LOSS, STATUS_OK, STOP_AFTER, TAG_AVERAGE,
                       TAG_BACKWARD, TAG_BCAST, TAG_BUFFERS, TAG_ERROR, TAG_FACTORS, TAG_GRAD, TAG_LOSS, TAG_PARAMS, TAG_REPORT, TAG_SETTINGS, TAG_INTRA, TAG_GATHER, BackwardReport, BufferStats,
                       Control, ErrorReport, FrameError, FrameHeader, FrameLength, LossReport, ServerReport,
                       error_frame, is_error_frame)

__all__ = ["WORLD", "Channel", "PeerFailed", "PeerTimeout", "ReceiveBuffers",
           "CHECKPOINT_AFTER", "CONTINUE", "STATUS_NONFINITE_LOSS",
           "STATUS_OK", "STOP_AFTER", "TAG_AVERAGE", "TAG_BACKWARD", "TAG_BCAST", "TAG_BUFFERS", "TAG_ERROR", "TAG_FACTORS", "TAG_GRAD", "TAG_SETTINGS",
           "TAG_INTRA", "TAG_GATHER", "TAG_LOSS", "TAG_PARAMS", "TAG_REPORT", "BackwardReport", "BufferStats", "Control", "ErrorReport", "FrameError", "FrameHeader", "FrameLength", "LossReport",
           "ServerReport", "error_frame", "is_error_frame"]
