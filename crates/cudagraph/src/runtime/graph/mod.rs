//! Graphs at the driver level, split by job: owned graphs and executable graphs with
//! hand-built nodes and host callbacks (`handle.rs`), reading nodes and edges back
//! (`nodes.rs`), the parameter rewrite behind `Graph::rebind` (`rebind.rs`), and conditional
//! nodes (`conditional.rs`). The user-facing `Graph`, its capture and its replay are one layer
//! up, in [`crate::graph`].

mod conditional;
mod handle;
mod nodes;
mod rebind;

pub(crate) use conditional::CondRecord;
pub use conditional::ConditionalKind;
pub(crate) use conditional::{
    add_conditional_node, begin_capture_to_graph, capture_info, conditional_handle_create,
    conditional_nodes_available, end_capture_to_graph, set_capture_dependencies,
};
pub(crate) use handle::{ExecHandle, GraphHandle, HostFn};
pub(crate) use nodes::{
    edges_of, kernel_node_name, node_type_code, node_types_of, nodes_of, NODE_TYPE_CONDITIONAL,
};
pub(crate) use rebind::{plan_rebind, references_range, Remap};
