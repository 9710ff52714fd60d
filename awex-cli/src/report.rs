//! An error as the command line prints it: the whole chain of causes, each said once.

/// `e` and its causes joined by `: ` (as `{:#}` joins them), leaving out a cause whose text the
/// message already holds: awex's errors carry the failing layer's error as their `source` and
/// often say it in their own text as well, which `{:#}` would repeat.
pub fn chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if text.is_empty() || out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::chain;
    use awex_runtime::{RuntimeError, ShmError};

    #[test]
    fn a_source_the_message_already_says_is_printed_once() {
        // the runtime's shared-memory error says its OS error and keeps it as its source, and
        // the runtime's error says the shared-memory error and keeps it as its source
        let io = std::io::Error::from_raw_os_error(2);
        let e = anyhow::Error::new(RuntimeError::from(ShmError::Os {
            op: "cannot open",
            name: "awex-x".into(),
            source: std::io::Error::from_raw_os_error(2),
        }))
        .context("training rank 0");
        assert_eq!(
            chain(&e),
            format!("training rank 0: shared memory: cannot open `/dev/shm/awex-x`: {io}")
        );
        // `{:#}` repeats both sources
        assert_eq!(format!("{e:#}").matches(&io.to_string()).count(), 3);
    }

    #[test]
    fn causes_the_message_does_not_say_are_all_printed() {
        let e = anyhow::anyhow!("the innermost")
            .context("the middle")
            .context("the outermost");
        assert_eq!(chain(&e), "the outermost: the middle: the innermost");
    }
}
