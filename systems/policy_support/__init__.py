"""Building blocks the KV policies share (token indicators, page selection, layer budget allocation, fixed-budget
bookkeeping, head profiles, tier traffic). Not policies: `system.policy` names only modules of systems/policies."""
