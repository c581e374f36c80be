//! CPU test of the crate's floor plan (ARCHITECTURE.md): every module of `src/` belongs to a
//! room, and a room imports only rooms on lower floors, so the rooms never form a circle.
//! Test code (`#[cfg(test)]` items) may reach anywhere; comments are not imports.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The floors, lowest first; a room may import only rooms of lower floors (and itself).
const FLOORS: &[&[&str]] = &[
    &["error", "extent", "env", "dtype"],
    &["ffi"],
    &["kernels"],
    &["engine"],
    &["random"],
    &["autograd"],
    &["nn"],
    &["io"],
    &["serving"],
    &["dist"],
    &["cpu"],
];

fn floor(room: &str) -> Option<usize> {
    FLOORS.iter().position(|f| f.contains(&room))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `text` without `//` comments and without the items under `#[cfg(test)]`.
fn code_of(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim_start().starts_with("#[cfg(test)]") {
            // Skip the item: to the `;` of a one-line item, or to its closing brace.
            let mut depth = 0i32;
            let mut opened = false;
            for l in lines.by_ref() {
                let l = l.split("//").next().unwrap_or("");
                depth += l.matches('{').count() as i32 - l.matches('}').count() as i32;
                opened |= l.contains('{');
                if (opened && depth <= 0) || (!opened && l.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        out.push_str(line.split("//").next().unwrap_or(""));
        out.push('\n');
    }
    out
}

/// The first path segment of every `crate::` path in `code`, grouped imports included.
fn rooms_used(code: &str) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
            continue; // `$crate::`, `super::crate` and the like
        }
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a::X, b};`: every top-level name in the braces.
            let mut depth = 0;
            let mut name = String::new();
            let mut at_start = true;
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => {
                        at_start = true;
                        continue;
                    }
                    _ => {}
                }
                if depth == 0 && at_start {
                    if c.is_alphanumeric() || c == '_' {
                        name.push(c);
                    } else if !name.is_empty() {
                        used.insert(std::mem::take(&mut name));
                        at_start = false;
                    }
                }
            }
            if !name.is_empty() {
                used.insert(name);
            }
        } else {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            used.insert(name);
        }
    }
    used
}

/// The crate's sources: where it was built, else the same path below the current directory
/// (test binaries carried to the GPU machine run from the repository root).
fn sources() -> PathBuf {
    let built = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let here = PathBuf::from("crates/cudagraph-nn/src");
    if !built.is_dir() && here.is_dir() {
        return here;
    }
    built
}

#[test]
fn rooms_import_only_rooms_on_lower_floors() {
    let src = sources();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut problems = Vec::new();
    for file in files {
        let rel = file.strip_prefix(&src).unwrap();
        if rel == Path::new("lib.rs") {
            continue;
        }
        let first = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy();
        let room = first.trim_end_matches(".rs").to_string();
        let Some(own) = floor(&room) else {
            problems.push(format!("{}: room {room} is on no floor", rel.display()));
            continue;
        };
        let code = code_of(&std::fs::read_to_string(&file).unwrap());
        for used in rooms_used(&code) {
            match floor(&used) {
                None => problems.push(format!(
                    "{}: imports crate::{used}, which is no room (import it from its room)",
                    rel.display()
                )),
                Some(f) if f > own => problems.push(format!(
                    "{}: room {room} (floor {own}) imports {used} (floor {f}), a room above it",
                    rel.display()
                )),
                Some(_) => {}
            }
        }
    }
    assert!(problems.is_empty(), "\n{}", problems.join("\n"));
}

#[test]
fn the_import_reader_sees_grouped_and_inline_paths_but_not_test_code() {
    let code = code_of(
        "use crate::error::Result;\nuse crate::{engine::Engines, kernels};\n\
         fn f() { crate::random::x(); } // crate::serving\n\
         #[cfg(test)]\nmod tests {\n    use crate::dist::X;\n}\n",
    );
    let used: Vec<String> = rooms_used(&code).into_iter().collect();
    assert_eq!(used, ["engine", "error", "kernels", "random"]);
}
