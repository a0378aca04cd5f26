"""The restore's store: plan SQL, the rewind, restore records, cut reads and imported snapshots."""
