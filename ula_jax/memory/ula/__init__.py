"""``ula``: one logical address per entry over every device and host pool.

``state`` (tables, owners, plans), ``dp`` (DP mode: a dp rank's device + host pools),
``tp`` (TP mode: a dp rank's history spread over its tp ranks, ``layouts``), ``policies``
(PB-LRU, exact LRU), ``resolve`` (logical top-k -> device slots: reference, fast path,
Pallas), ``atomics`` (the Pallas kernels' atomics), ``oracle`` (a NumPy model the property
tests check against), ``trace`` (selection traces and policy replay).
"""
