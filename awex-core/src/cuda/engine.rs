//! The copy engine: issues copy descriptors on a few streams, ordered by events.
//!
//! An update is one batch: every stream waits, on the device, for the event that says the
//! source is ready (the training side records it; through an IPC event handle when it is
//! another process), the descriptors are spread over the streams by bytes, the streams join
//! back into the first one, and a `done` event is recorded there for whoever must not touch
//! the memory before the copies end. The host never polls per tensor. A batch that repeats
//! with the same addresses can be captured once into a CUDA graph and replayed with one launch.

use super::desc::CopyDesc;
use super::device::{Device, Event, Stream};
use super::raw::RawGraphExec;
use super::{CudaError, sys};

/// Which stream each descriptor goes to: in submission order, each to the stream with the
/// fewest bytes queued so far (ties to the lowest index).
pub fn assign_streams(descs: &[CopyDesc], streams: usize) -> Vec<usize> {
    let mut load = vec![0u64; streams.max(1)];
    descs
        .iter()
        .map(|d| {
            let (k, _) = load
                .iter()
                .enumerate()
                .min_by_key(|&(i, &l)| (l, i))
                .unwrap_or((0, &0));
            load[k] += d.bytes();
            k
        })
        .collect()
}

/// Runs batches of device-to-device copies on a fixed set of streams.
pub struct CopyEngine {
    dev: Device,
    streams: Vec<Stream>,
    /// joins[k] is recorded on stream k and waited on by stream 0; joins[0] forks captures
    joins: Vec<Event>,
}

/// A batch captured into a CUDA graph, replayed with [`CopyEngine::replay`].
pub struct CopyGraph {
    dev: Device,
    exec: RawGraphExec,
    /// Descriptors in the graph.
    pub copies: usize,
}

impl Drop for CopyGraph {
    fn drop(&mut self) {
        let _ = self.dev.bind().and_then(|_| sys::graph_destroy(self.exec));
    }
}

impl CopyEngine {
    /// An engine with `streams` streams on `dev`.
    pub fn new(dev: &Device, streams: usize) -> Result<CopyEngine, CudaError> {
        if streams == 0 {
            return Err(CudaError::Streams(0));
        }
        let mut s = Vec::with_capacity(streams);
        let mut j = Vec::with_capacity(streams);
        for _ in 0..streams {
            s.push(dev.stream()?);
            j.push(dev.event(false)?);
        }
        Ok(CopyEngine {
            dev: dev.clone(),
            streams: s,
            joins: j,
        })
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Number of streams.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    /// The first stream, where batches end and `done` is recorded.
    pub fn main_stream(&self) -> &Stream {
        &self.streams[0]
    }

    fn queue_copies(&self, descs: &[CopyDesc]) -> Result<(), CudaError> {
        for (d, k) in descs.iter().zip(assign_streams(descs, self.streams.len())) {
            sys::copy_async(d, self.streams[k].raw).map_err(|e| CudaError::Copy {
                desc: format!("{d:?}"),
                detail: e.to_string(),
            })?;
        }
        for k in 1..self.streams.len() {
            self.joins[k].record(&self.streams[k])?;
            self.streams[0].wait(&self.joins[k])?;
        }
        Ok(())
    }

    /// Queues a batch: waits for `after` on every stream, copies, records `done` at the end.
    /// Returns once queued; [`CopyEngine::sync`] waits for the end.
    pub fn launch(
        &self,
        descs: &[CopyDesc],
        after: Option<&Event>,
        done: Option<&Event>,
    ) -> Result<(), CudaError> {
        self.dev.bind()?;
        if let Some(e) = after {
            for s in &self.streams {
                s.wait(e)?;
            }
        }
        self.queue_copies(descs)?;
        if let Some(e) = done {
            e.record(&self.streams[0])?;
        }
        Ok(())
    }

    /// Captures a batch into a graph (nothing runs until [`CopyEngine::replay`]).
    pub fn capture(&self, descs: &[CopyDesc]) -> Result<CopyGraph, CudaError> {
        self.dev.bind()?;
        let s0 = &self.streams[0];
        sys::capture_begin(s0.raw)?;
        let body = (|| {
            // fork the other streams off the capturing one so their copies join the graph
            self.joins[0].record(s0)?;
            for s in &self.streams[1..] {
                s.wait(&self.joins[0])?;
            }
            self.queue_copies(descs)
        })();
        // end the capture whatever happened, so the stream is usable again
        let exec = sys::capture_end(s0.raw);
        body?;
        Ok(CopyGraph {
            dev: self.dev.clone(),
            exec: exec?,
            copies: descs.len(),
        })
    }

    /// Queues a captured batch after `after`, recording `done` at its end.
    pub fn replay(
        &self,
        g: &CopyGraph,
        after: Option<&Event>,
        done: Option<&Event>,
    ) -> Result<(), CudaError> {
        self.dev.bind()?;
        let s0 = &self.streams[0];
        if let Some(e) = after {
            s0.wait(e)?;
        }
        sys::graph_launch(g.exec, s0.raw)?;
        if let Some(e) = done {
            e.record(s0)?;
        }
        Ok(())
    }

    /// Blocks until every queued batch has finished.
    pub fn sync(&self) -> Result<(), CudaError> {
        self.streams[0].sync()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streams_are_balanced_by_bytes_in_submission_order() {
        let d = |n| CopyDesc::linear(0, 0, n);
        let descs = [d(100), d(10), d(10), d(50), d(5), d(40)];
        assert_eq!(assign_streams(&descs, 2), vec![0, 1, 1, 1, 1, 1]);
        assert_eq!(assign_streams(&descs, 3), vec![0, 1, 2, 1, 2, 2]);
        assert_eq!(assign_streams(&descs, 1), vec![0; 6]);
    }
}
