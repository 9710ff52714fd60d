//! Links every backend crate so their inventory registrations are visible to the tests.
