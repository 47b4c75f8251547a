"""The connector's worker half (``half.WorkerHalf``): fetch, check and load a step's entries
(``loading``), gather what it saved into entries on the writer thread (``entry_builder``), and form
patches from them (``patching``) off the forward (``patch_queue``)."""
