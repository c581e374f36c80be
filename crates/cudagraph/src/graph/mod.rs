//! Capture and replay: [`Graph::capture`] records work issued on a [`CaptureStream`] into a
//! CUDA graph, [`Graph::replay`] runs it with one launch, [`StaticGraph`] adds static inputs and
//! outputs (copy in, replay, read out) and [`warmup`] runs work on a side stream first.
//!
//! Safety by construction:
//! - the capture closure only gets a [`CaptureStream`], which has no synchronising or
//!   device-to-host method, and whose library view ([`crate::StreamRef`]) cannot wait either
//!   (the stream itself is borrowed mutably for the whole capture);
//! - every allocation inside the closure comes from the graph's pool;
//! - a graph holds its pool and every buffer, kernel module and host callback it uses, so
//!   dropping user handles can never leave a dangling address in a graph;
//! - a graph never releases anything while a replay may still run: each replay records an
//!   event, and dropping the graph (or rebinding away from a buffer) waits for it — or, where
//!   waiting is not allowed (on a thread that is capturing), hands the resources to a
//!   deferred-release list drained once the event has completed. Every recording of the event
//!   covers every earlier replay (the first replay after a re-instantiation waits for it), so
//!   a later replay recording it again never shortens a deferred release; a replay whose event
//!   could not be recorded makes the graph wait for the whole device before it releases
//!   anything (or, where it cannot, keep everything);
//! - rebind lets go only of buffers it moved the graph away from and proved unreferenced, and
//!   refuses graphs it cannot read completely;
//! - the driver's graph objects are not thread-safe, so a graph serialises its own calls;
//! - a capture that fails for any reason (the closure's error, a panic, or the driver
//!   invalidating it) is ended and discarded: the stream and the pool are usable afterwards.
//!
//! Work can branch onto a second stream and come back ([`Fork::fork`] gives a [`SideStream`],
//! [`SideStream::join`] ends it): eagerly that is two streams ordered by events; inside a
//! capture the side stream joins the capture, so the graph gets a parallel branch (NCCL
//! collectives beside the backward pass, say). A side branch allocates from the capture's
//!
//! Files by job, lowest first: `retire.rs` (deferred release), `keep.rs` (what a graph keeps
//! alive), `exec.rs` ([`Graph`], replay, [`GraphInfo`]), `rebind.rs` ([`Graph::rebind`]),
//! `topology.rs` (node counts and drawings), `capture.rs` ([`Graph::capture`],
//! [`CaptureStream`], [`CaptureOptions`]), `conditional.rs` (IF / WHILE bodies), `fork.rs`
//! ([`Fork`], [`SideStream`], [`warmup`]), `builder.rs` ([`GraphBuilder`]), `static_io.rs`
//! ([`StaticGraph`]), [`cache`] ([`GraphCache`]), [`planner`] ([`plan_capture_sizes`]).

mod builder;
pub mod cache;
mod capture;
mod conditional;
mod exec;
mod fork;
mod keep;
pub mod planner;
mod rebind;
mod retire;
mod static_io;
mod topology;

pub use builder::{GraphBuilder, NodeId};
pub use cache::{
    bucket_for, BatchModel, BucketPolicy, CacheOptions, CacheOutput, CacheStats, Choice, EntryInfo,
    GraphCache, Selection, Served, Staged,
};
pub use capture::{CaptureOptions, CaptureStream};
pub use exec::{ConditionalCounts, Graph, GraphInfo, GraphMemory, NodeCounts};
pub use fork::{warmup, Fork, SideStream};
pub use planner::{plan_capture_sizes, CapturePlan, GraphCost, SizeHistogram};
pub use rebind::RebindOutcome;
pub use static_io::{Outputs, StaticGraph};

pub use crate::runtime::graph::ConditionalKind;
