//! Request and attempt ids: random (version 4) UUIDs drawn from the thread's
//! seeded generator. `Uuid::new_v4` asks the kernel (`getrandom`) for every
//! id, two syscalls per request on the hop's hot path (issue 20); an id only
//! has to be unique, not secret.
use uuid::Uuid;

/// A random UUID.
pub fn uuid_v4() -> Uuid {
    uuid::Builder::from_random_bytes(rand::random()).into_uuid()
}

#[cfg(test)]
mod tests {
    #[test]
    fn ids_are_version_4_and_differ() {
        let (a, b) = (super::uuid_v4(), super::uuid_v4());
        assert_eq!(a.get_version_num(), 4);
        assert_eq!(a.get_variant(), uuid::Variant::RFC4122);
        assert_ne!(a, b);
    }
}
