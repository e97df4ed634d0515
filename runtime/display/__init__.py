"""What a command shows while it works: the ``progress`` section (``config``), a line redrawn in place on a
terminal (``live``), the stages before the first batch (``stages``) and where the wall time went (``timeline``).
Below the driver and ``conversations``, which both show their work with it."""
