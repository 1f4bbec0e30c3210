"""``far_tier``: KV in a disaggregated far pool (CXL / RDMA), fetched per layer
(``system``), with the links' timing model (``link_model``)."""
