//! An error as the command line prints it: the whole chain of causes, each said once.

/// `e` and its causes joined by `: ` (as `{:#}` joins them), leaving out a cause whose text the
/// error it is the source of already holds: awex's errors carry the failing layer's error as
/// their `source` and often say it in their own text as well, which `{:#}` would repeat. Only
/// the enclosing error's text is searched, so a short cause that happens to appear further up
/// the chain ("timed out") is still printed.
pub fn chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    let mut enclosing = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if !text.is_empty() && !enclosing.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        enclosing = text;
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

    #[test]
    fn a_cause_said_higher_up_but_not_by_its_own_enclosing_error_is_printed() {
        let e = anyhow::anyhow!("timed out")
            .context("waiting for rank 3")
            .context("rank 1 timed out earlier; then");
        assert_eq!(
            chain(&e),
            "rank 1 timed out earlier; then: waiting for rank 3: timed out"
        );
    }
}
