"""Getting back to training after a fault: the node-local restore tier and its staging arena, the reusable DCP stager,
in-process restarts, step heartbeats and the hang rule, the early CUDA context, and the start-up anatomy that
measures where a recovery's seconds went."""
