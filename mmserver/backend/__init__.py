"""Backend processes: where models are loaded and predictions run, never on the event loop.

The only package that touches :mod:`multiprocessing`. A :class:`BackendPool` owns a fixed number
of *slots*; each slot is one long-lived process (:class:`ProcessSlot`) or, with
``backend_processes = 0``, a thread pool inside the frontend (:class:`ThreadSlot`, for
development and tests). Workers of the frontend are bound to a slot and send it batches.

The parts:

- :mod:`~mmserver.backend.wire`: the messages and their framing on the pipe;
- :mod:`~mmserver.backend.child`: inside a backend process, the models and the message loop;
- :mod:`~mmserver.backend.batching`: answering a batch where the model runs;
- :mod:`~mmserver.backend.slot`: what both kinds of slot share (a message awaiting its reply);
- :mod:`~mmserver.backend.process_slot`: the frontend's side of one process: batches admitted
  into its pipe, messages written and their replies read in order, deadlines;
- :mod:`~mmserver.backend.lifetime`: that process's start, and its replacement when it dies, a
  prediction passes its deadline or it is recycled;
- :mod:`~mmserver.backend.process`: the operating-system process itself;
- :mod:`~mmserver.backend.loads`: the models loaded in it, their loads' turns and the memory the
  loads measured;
- :mod:`~mmserver.backend.thread_slot`: the in-process slot;
- :mod:`~mmserver.backend.placement`: the pool of slots, in their lanes, and where a worker goes.

The process handles messages strictly in order and answers each one, so the frontend matches
replies to requests by order: the oldest unanswered message is the one *running*; those after
it are *waiting* (:func:`~mmserver.backend.batching.answer_batch` runs in the process).

Faults: when a process dies, the message it was running fails with :class:`BackendDied`; a new
process is started, every model that was loaded in the slot is loaded again, and the waiting
messages are sent to it in their original order. When a prediction passes its deadline while
running, it is answered with :class:`PredictTimeout` and the process is replaced the same way, so
no worker stays stuck behind it.

The package's own module holds nothing else: a model environment's interpreter imports
:mod:`~mmserver.backend.child` through it, and has none of the frontend's libraries. Import each
name from its module (:class:`~mmserver.backend.placement.BackendPool`...).
"""
