"""The ``hdet`` command: training runs on embedded tasks, comparisons and plots. An application of the
library above it (``hdet.schedulers``, ``hdet.engine``); nothing in the library imports from here."""
