//! What a captured graph is made of, for people: conditional nodes and their bodies counted
//! by kind, programmatic (PDL) edges counted, and a compact Graphviz drawing
//! ([`Graph::write_topology_dot`]) where conditional bodies are clusters and programmatic
//! edges are dashed. The driver's own, verbose dump stays [`Graph::write_dot`].

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use super::exec::{ConditionalCounts, Graph, NodeCounts};
use crate::error::{Error, Result};
use crate::runtime::graph::{self as raw, CondRecord, ConditionalKind};
use crate::runtime::raw::RawGraph;

impl NodeCounts {
    fn add(&mut self, o: &NodeCounts) {
        self.kernel += o.kernel;
        self.memcpy += o.memcpy;
        self.memset += o.memset;
        self.host += o.host;
        self.child_graph += o.child_graph;
        self.empty += o.empty;
        self.conditional += o.conditional;
        self.other += o.other;
    }
}

/// Programmatic edges of `g` (0 when the driver cannot list edges: the count is for
/// display, and a capture must not fail over it).
fn programmatic_edges(g: RawGraph) -> usize {
    raw::nodes_of(g)
        .and_then(|nodes| raw::edges_of(g, &nodes))
        .map(|edges| edges.iter().filter(|e| e.programmatic).count())
        .unwrap_or(0)
}

impl Graph {
    /// Takes over the conditional nodes a capture recorded and counts what the graph holds:
    /// conditional kinds, body nodes, programmatic edges (top level and bodies).
    pub(crate) fn adopt_conditionals(&mut self, conds: Vec<CondRecord>) -> Result<()> {
        self.device.context().bind()?;
        let mut res = self.lock();
        let mut counts = ConditionalCounts::default();
        let mut pdl = programmatic_edges(res.exec.graph.raw());
        for c in &conds {
            match c.kind {
                ConditionalKind::If => counts.if_nodes += 1,
                ConditionalKind::While => counts.while_nodes += 1,
            }
            counts
                .body_nodes
                .add(&NodeCounts::from_types(&raw::node_types_of(c.body)?));
            pdl += programmatic_edges(c.body);
        }
        res.conds = conds;
        drop(res);
        self.info.conditionals = counts;
        self.info.programmatic_edges = pdl;
        Ok(())
    }

    /// Writes a compact Graphviz drawing of the graph to `path`: one box per node (kernels by
    /// name where the driver can tell), conditional nodes as diamonds with their bodies as
    /// clusters, programmatic (PDL) edges dashed and labelled. [`Self::write_dot`] writes the
    /// driver's verbose dump instead.
    #[track_caller]
    pub fn write_topology_dot(&self, path: &Path) -> Result<()> {
        self.device.context().bind()?;
        let res = self.lock();
        let mut w = DotWriter {
            out: String::new(),
            next_cluster: 0,
            conds: res.conds.iter().map(|c| (c.node.0 as usize, *c)).collect(),
        };
        w.out.push_str(
            "digraph cudagraph {\n  compound=true;\n  node [shape=box, fontsize=10, fontname=\"sans-serif\"];\n",
        );
        w.graph(res.exec.graph.raw(), "graph", 1)?;
        w.out.push_str("}\n");
        drop(res);
        std::fs::write(path, w.out).map_err(|e| Error::InvalidGraph {
            problem: format!("could not write {}: {e}", path.display()),
        })
    }
}

struct DotWriter {
    out: String,
    next_cluster: usize,
    conds: HashMap<usize, CondRecord>,
}

impl DotWriter {
    /// Writes `g` as a cluster; returns the DOT id of its first node (for edges into it).
    fn graph(&mut self, g: RawGraph, label: &str, indent: usize) -> Result<Option<String>> {
        let cluster = self.next_cluster;
        self.next_cluster += 1;
        let pad = "  ".repeat(indent);
        let _ = writeln!(
            self.out,
            "{pad}subgraph cluster_{cluster} {{\n{pad}  label=\"{label}\";"
        );
        let nodes = raw::nodes_of(g)?;
        let id = |i: usize| format!("n{cluster}_{i}");
        let mut bodies = Vec::new();
        for (i, &node) in nodes.iter().enumerate() {
            let t = raw::node_type_code(node)?;
            let (shape, text) = match t {
                0 => (
                    "box",
                    raw::kernel_node_name(node).unwrap_or_else(|| "kernel".into()),
                ),
                1 => ("box", "memcpy".into()),
                2 => ("box", "memset".into()),
                3 => ("box", "host fn".into()),
                4 => ("box", "child graph".into()),
                5 => ("point", String::new()),
                t if t == raw::NODE_TYPE_CONDITIONAL => {
                    let rec = self.conds.get(&(node as usize)).copied();
                    let kind = match rec.map(|r| r.kind) {
                        Some(ConditionalKind::If) => "IF",
                        Some(ConditionalKind::While) => "WHILE",
                        None => "conditional",
                    };
                    if let Some(r) = rec {
                        bodies.push((i, r, kind));
                    }
                    ("diamond", kind.into())
                }
                t => ("box", format!("node type {t}")),
            };
            let _ = writeln!(
                self.out,
                "{pad}  {} [shape={shape}, label=\"{}\"];",
                id(i),
                text.replace('"', "'")
            );
        }
        for e in raw::edges_of(g, &nodes)? {
            let style = if e.programmatic {
                " [style=dashed, color=\"#c03030\", label=\"PDL\", fontsize=8]"
            } else {
                ""
            };
            let _ = writeln!(self.out, "{pad}  {} -> {}{style};", id(e.from), id(e.to));
        }
        for (i, r, kind) in bodies {
            let body_cluster = self.next_cluster;
            if let Some(first) = self.graph(r.body, &format!("{kind} body"), indent + 1)? {
                let _ = writeln!(
                    self.out,
                    "{pad}  {} -> {first} [style=dotted, lhead=cluster_{body_cluster}];",
                    id(i)
                );
            }
        }
        let _ = writeln!(self.out, "{pad}}}");
        Ok((!nodes.is_empty()).then(|| id(0)))
    }
}
