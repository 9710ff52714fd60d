//! Progress on stderr: a bar on a terminal, plain lines otherwise (a pipe, a log file), so that
//! stdout holds only the table or the JSON and something appears within a second either way.

use std::io::IsTerminal;

/// Where the demo says what it is doing.
#[derive(Default)]
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
}

impl Progress {
    /// Starts the update bar (on a terminal only).
    pub fn start_updates(&mut self, updates: u64) {
        if !std::io::stderr().is_terminal() {
            return;
        }
        let b = indicatif::ProgressBar::new(updates);
        b.set_style(
            indicatif::ProgressStyle::with_template("{spinner} update {pos}/{len} {wide_msg}")
                .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        self.bar = Some(b);
    }

    /// One line: above the bar on a terminal, else `awex demo: LINE` on stderr.
    pub fn say(&self, line: &str) {
        match &self.bar {
            Some(b) => b.println(format!("awex demo: {line}")),
            None => eprintln!("awex demo: {line}"),
        }
    }

    /// The bar's message (the version being moved).
    pub fn message(&self, m: String) {
        if let Some(b) = &self.bar {
            b.set_message(m);
        }
    }

    /// One update done.
    pub fn inc(&self) {
        if let Some(b) = &self.bar {
            b.inc(1);
        }
    }

    /// Removes the bar.
    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}
