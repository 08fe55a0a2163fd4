//! Imports flow one way. The crate's top-level modules sit on layers, and a
//! module refers (`crate::…`, `super::…`) only to modules on lower layers,
//! so there is no cycle between them; the actors' files form no cycle
//! either. Read from `src/**/*.rs`, leaving out what is compiled for tests
//! only (`#[cfg(test)]` items and the files of `#[cfg(test)] mod x;`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Lowest first: a module may refer only to modules on the lines above it.
const LAYERS: &[&[&str]] = &[
    // Leaves: they know no other module of the crate.
    &["metrics", "backoff", "redact", "jsonb"],
    // Which route takes an event; the `[[routes]]` section.
    &["routes"],
    // Delivery and the database; each sink owns its section.
    &["sink", "store"],
    // Delivery spans over OTLP; its section.
    &["telemetry"],
    // Puts the sections together.
    &["config"],
    &["actors"],
    &["relay"],
    &["server", "janitor"],
    &["daemon"],
    &["cli"],
];

/// The modules whose files must not form a cycle among themselves.
const NO_CYCLES_BETWEEN_FILES_OF: &[&str] = &["actors"];

#[test]
fn top_level_modules_refer_only_to_lower_layers() {
    let crate_refs = scan_crate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    let graph = crate_refs.top_level_edges();
    if let Some(cycle) = find_cycle(&graph) {
        panic!(
            "an import cycle between top-level modules: {}",
            cycle.join(" → ")
        );
    }
    let layer_of: BTreeMap<&str, usize> = LAYERS
        .iter()
        .enumerate()
        .flat_map(|(i, names)| names.iter().map(move |n| (*n, i)))
        .collect();
    let mut wrong = Vec::new();
    for module in &crate_refs.top_level_modules {
        if !layer_of.contains_key(module.as_str()) {
            wrong.push(format!("`{module}` is on no layer: add it to LAYERS"));
        }
    }
    for (from, tos) in &graph {
        for to in tos {
            let allowed = match (layer_of.get(from.as_str()), layer_of.get(to.as_str())) {
                (Some(f), Some(t)) => t < f,
                // Reported above.
                _ => true,
            };
            if !allowed {
                wrong.push(format!(
                    "`{from}` refers to `{to}` ({})",
                    crate_refs.example(from, to)
                ));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "imports must flow one way (layers, lowest first: {LAYERS:?}):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_files_of_the_actors_form_no_cycle() {
    let crate_refs = scan_crate(&Path::new(env!("CARGO_MANIFEST_DIR")).join("src"));
    for module in NO_CYCLES_BETWEEN_FILES_OF {
        let graph = crate_refs.file_edges(module);
        assert!(
            !graph.is_empty(),
            "the files of `{module}` refer to none of each other: is the scan blind?"
        );
        if let Some(cycle) = find_cycle(&graph) {
            panic!(
                "an import cycle between the files of `{module}`: {}",
                cycle.join(" → ")
            );
        }
    }
}

/// The scan itself: what counts as a reference and what does not.
#[test]
fn the_scan_sees_references_and_skips_comments_strings_and_tests() {
    let source = r###"
        //! Doc text naming crate::docs_only.
        use crate::{alpha::A, beta::{self, B}};
        use super::gamma::{G, H as I};
        use super::super::delta;
        /* crate::in_block_comment /* nested crate::nested */ */
        const S: &str = "crate::in_string";
        const R: &str = r#"crate::in_raw " string"#;
        const C: char = '"';
        fn f<'a>(x: &'a str) -> crate::epsilon::E<'a> { crate::zeta::z(x, '\'') }
        macro_rules! m { () => { $crate::eta::M } }
        #[cfg(test)]
        mod tests {
            use crate::only_in_tests;
        }
        #[cfg(test)]
        #[allow(dead_code)]
        fn helper() -> crate::only_in_tests_too::T { todo!() }
        #[cfg(test)]
        mod test_file;
        mod inline {
            use super::theta;
            fn g() { crate::iota::i() }
        }
        fn after() -> crate::kappa::K { crate::kappa::K }
    "###;
    let scanned = scan_source(source, &["top".to_owned(), "file".to_owned()]);
    let targets: BTreeSet<Vec<String>> = scanned.paths.iter().map(|(_, p)| p.clone()).collect();
    let path = |s: &str| s.split("::").map(str::to_owned).collect::<Vec<_>>();
    let want: BTreeSet<Vec<String>> = [
        "alpha::A",
        "beta::self",
        "beta::B",
        "top::gamma::G",
        "top::gamma::H",
        "delta",
        "epsilon::E",
        "zeta::z",
        "eta::M",
        "top::file::theta",
        "iota::i",
        "kappa::K",
    ]
    .into_iter()
    .map(path)
    .collect();
    assert_eq!(targets, want);
    assert_eq!(scanned.test_files, ["test_file".to_owned()]);
    // A file that is a test module of its own is left out entirely.
    let only_tests = scan_source("#![cfg(test)]\nuse crate::alpha::A;\n", &["top".to_owned()]);
    assert!(only_tests.paths.is_empty());
}

// ---------------------------------------------------------------------------

/// Every reference between the crate's modules, outside test code.
struct CrateRefs {
    top_level_modules: BTreeSet<String>,
    refs: Vec<Ref>,
}

/// Module `from` (the file's module path, `["sink", "qstash"]`) names `to`
/// (a path from the crate root) at `file:line`.
struct Ref {
    from: Vec<String>,
    to: Vec<String>,
    file: PathBuf,
    line: usize,
}

impl CrateRefs {
    /// Top-level module → the top-level modules it refers to.
    fn top_level_edges(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for Ref { from, to, .. } in &self.refs {
            if from[0] != to[0] {
                graph
                    .entry(from[0].clone())
                    .or_default()
                    .insert(to[0].clone());
            }
        }
        graph
    }

    /// File of `module` → the files of `module` it refers to (its `mod.rs`
    /// aside, which only declares and re-exports them).
    fn file_edges(&self, module: &str) -> BTreeMap<String, BTreeSet<String>> {
        let files: BTreeSet<&String> = self
            .refs
            .iter()
            .filter(|r| r.from[0] == module && r.from.len() > 1)
            .map(|r| &r.from[1])
            .collect();
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for Ref { from, to, .. } in &self.refs {
            if from[0] == module
                && to[0] == module
                && from.len() > 1
                && to.len() > 1
                && from[1] != to[1]
                && files.contains(&to[1])
            {
                graph
                    .entry(from[1].clone())
                    .or_default()
                    .insert(to[1].clone());
            }
        }
        graph
    }

    /// Where `from` refers to `to`, for the failure message.
    fn example(&self, from: &str, to: &str) -> String {
        self.refs
            .iter()
            .find(|r| r.from[0] == from && r.to[0] == to)
            .map(|r| {
                format!(
                    "`crate::{}` in {}:{}",
                    r.to.join("::"),
                    r.file.display(),
                    r.line
                )
            })
            .unwrap_or_default()
    }
}

fn scan_crate(src: &Path) -> CrateRefs {
    let mut files = Vec::new();
    collect_rs(src, &mut files);
    files.sort();
    let module_path = |file: &Path| -> Vec<String> {
        let rel = file.strip_prefix(src).unwrap().with_extension("");
        let mut parts: Vec<String> = rel
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if parts.last().is_some_and(|p| p == "mod") {
            parts.pop();
        }
        parts
    };
    let mut scanned = BTreeMap::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let path = module_path(file);
        scanned.insert(file.clone(), (path.clone(), scan_source(&text, &path)));
    }
    // Files that are `#[cfg(test)] mod x;` of their parent.
    let mut test_files = BTreeSet::new();
    let mut test_dirs = BTreeSet::new();
    for (file, (_, s)) in &scanned {
        let dir = if file
            .file_name()
            .is_some_and(|n| n == "mod.rs" || n == "lib.rs" || n == "main.rs")
        {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        for name in &s.test_files {
            test_files.insert(dir.join(format!("{name}.rs")));
            test_dirs.insert(dir.join(name));
        }
    }
    // A test module's own submodules (`tests/mod.rs` with `mod x;`) are test
    // code too.
    test_files.extend(
        scanned
            .keys()
            .filter(|file| test_dirs.iter().any(|d| file.starts_with(d)))
            .cloned()
            .collect::<Vec<_>>(),
    );
    // The crate roots declare the modules and re-export some of their items
    // (`crate::Config` is `crate::config::Config`); the binary is a crate of
    // its own.
    let root = |name: &str| vec![name.to_owned()];
    let roots = [root("lib"), root("main")];
    let top_level_modules: BTreeSet<String> = scanned
        .iter()
        .filter(|(file, (path, _))| !roots.contains(path) && !test_files.contains(*file))
        .map(|(_, (path, _))| path[0].clone())
        .collect();
    let lib = &scanned[&src.join("lib.rs")].1;
    let re_exports: BTreeMap<String, String> = lib
        .uses
        .iter()
        .filter(|p| p.len() > 1 && top_level_modules.contains(&p[0]))
        .map(|p| (p.last().unwrap().clone(), p[0].clone()))
        .collect();
    let mut refs = Vec::new();
    for (file, (from, s)) in &scanned {
        if roots.contains(from) || test_files.contains(file) {
            continue;
        }
        for (line, to) in &s.paths {
            let Some(first) = to.first() else { continue };
            let to = if top_level_modules.contains(first) {
                to.clone()
            } else if let Some(module) = re_exports.get(first) {
                std::iter::once(module.clone())
                    .chain(to.iter().cloned())
                    .collect()
            } else {
                panic!(
                    "{}:{line}: `crate::{}` names no module of the crate",
                    file.display(),
                    to.join("::")
                )
            };
            refs.push(Ref {
                from: from.clone(),
                to,
                file: file.strip_prefix(src.parent().unwrap()).unwrap().into(),
                line: *line,
            });
        }
    }
    CrateRefs {
        top_level_modules,
        refs,
    }
}

fn collect_rs(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            collect_rs(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// A cycle in `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|n| n == node) {
            let mut cycle = stack[at..].to_vec();
            cycle.push(node.to_owned());
            return Some(cycle);
        }
        if done.contains(node) {
            return None;
        }
        stack.push(node.to_owned());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, done, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        done.insert(node.to_owned());
        None
    }
    let mut done = BTreeSet::new();
    graph
        .keys()
        .find_map(|node| visit(node, graph, &mut done, &mut Vec::new()))
}

// ---------------------------------------------------------------------------
// A small reader of Rust source: enough to find paths, not a parser.

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
}

struct Scanned {
    /// (line, absolute path from the crate root) of every `crate::`,
    /// `super::` and `self::` path outside test code.
    paths: Vec<(usize, Vec<String>)>,
    /// The paths of `use` items relative to the file (for the crate root's
    /// re-exports).
    uses: Vec<Vec<String>>,
    /// `x` of each `#[cfg(test)] mod x;`.
    test_files: Vec<String>,
}

/// `module` is the file's module path (`["sink", "qstash"]`).
fn scan_source(source: &str, module: &[String]) -> Scanned {
    let tokens = tokenize(&code_only(source));
    let mut scanned = Scanned {
        paths: Vec::new(),
        uses: Vec::new(),
        test_files: Vec::new(),
    };
    // `#![cfg(test)]`: the whole file is test code.
    if tokens.len() > 7
        && tokens[..3].iter().map(|t| &t.1).eq(&[
            Token::Punct('#'),
            Token::Punct('!'),
            Token::Punct('['),
        ])
        && is_cfg_test(&tokens[3..])
    {
        return scanned;
    }
    // Inline modules open at a brace depth: (name, depth).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < tokens.len() {
        let (line, token) = &tokens[i];
        match token {
            Token::Punct('#')
                if tokens.get(i + 1).map(|t| &t.1) == Some(&Token::Punct('['))
                    && is_cfg_test(&tokens[i + 2..]) =>
            {
                i = skip_item(&tokens, i + 2 + 5, &mut scanned.test_files);
                continue;
            }
            Token::Punct('{') => depth += 1,
            Token::Punct('}') => {
                depth = depth.saturating_sub(1);
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
            }
            Token::Ident(kw) if kw == "mod" => {
                if let (Some((_, Token::Ident(name))), Some((_, Token::Punct('{')))) =
                    (tokens.get(i + 1), tokens.get(i + 2))
                {
                    inline.push((name.clone(), depth));
                    depth += 1;
                    i += 3;
                    continue;
                }
            }
            Token::Ident(kw) if kw == "use" => {
                let (trees, _) = use_tree(&tokens, i + 1, Vec::new());
                scanned.uses.extend(trees);
            }
            Token::Ident(start)
                if matches!(start.as_str(), "crate" | "super" | "self")
                    && tokens.get(i + 1).map(|t| &t.1) == Some(&Token::PathSep)
                    && (i == 0 || tokens[i - 1].1 != Token::PathSep) =>
            {
                let (trees, next) = use_tree(&tokens, i, Vec::new());
                let mut here: Vec<String> = module.to_vec();
                here.extend(inline.iter().map(|(name, _)| name.clone()));
                for tree in trees {
                    if let Some(path) = resolve(&tree, &here) {
                        scanned.paths.push((*line, path));
                    }
                }
                i = next;
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    scanned
}

/// `cfg(test)]` at the start of `tokens` (after `#[`).
fn is_cfg_test(tokens: &[(usize, Token)]) -> bool {
    let want = [
        Token::Ident("cfg".into()),
        Token::Punct('('),
        Token::Ident("test".into()),
        Token::Punct(')'),
        Token::Punct(']'),
    ];
    tokens.len() >= want.len() && tokens[..want.len()].iter().map(|t| &t.1).eq(want.iter())
}

/// Skips the item that starts at `i` (after its `#[cfg(test)]`), with any
/// further attributes; returns the index after it. A `mod x;` is recorded.
fn skip_item(tokens: &[(usize, Token)], mut i: usize, test_files: &mut Vec<String>) -> usize {
    while tokens.get(i).map(|t| &t.1) == Some(&Token::Punct('#')) {
        let mut depth = 0;
        loop {
            match tokens.get(i).map(|t| &t.1) {
                Some(Token::Punct('[')) => depth += 1,
                Some(Token::Punct(']')) => {
                    depth -= 1;
                    if depth == 0 {
                        i += 1;
                        break;
                    }
                }
                None => return i,
                _ => {}
            }
            i += 1;
        }
    }
    let start = i;
    let mut depth = 0i32;
    while let Some((_, t)) = tokens.get(i) {
        i += 1;
        match t {
            Token::Punct('(' | '[' | '{') => depth += 1,
            Token::Punct(')' | ']') => depth -= 1,
            Token::Punct('}') => {
                depth -= 1;
                if depth == 0 {
                    if tokens.get(i).map(|t| &t.1) == Some(&Token::Punct(';')) {
                        i += 1;
                    }
                    return i;
                }
            }
            Token::Punct(';') if depth == 0 => {
                let item: Vec<&Token> = tokens[start..i].iter().map(|t| &t.1).collect();
                if let [.., Token::Ident(kw), Token::Ident(name), Token::Punct(';')] = item[..] {
                    if kw == "mod" {
                        test_files.push(name.clone());
                    }
                }
                return i;
            }
            _ => {}
        }
    }
    i
}

/// The paths of a use tree (or of a path in an expression) starting at
/// `i`, each with `prefix` in front; and the index after it.
fn use_tree(
    tokens: &[(usize, Token)],
    mut i: usize,
    prefix: Vec<String>,
) -> (Vec<Vec<String>>, usize) {
    let mut path = prefix;
    loop {
        match tokens.get(i).map(|t| &t.1) {
            Some(Token::Punct('{')) => {
                let mut all = Vec::new();
                i += 1;
                loop {
                    match tokens.get(i).map(|t| &t.1) {
                        Some(Token::Punct('}')) => return (all, i + 1),
                        Some(Token::Punct(',')) => i += 1,
                        None => return (all, i),
                        _ => {
                            let (trees, next) = use_tree(tokens, i, path.clone());
                            all.extend(trees);
                            i = next;
                        }
                    }
                }
            }
            Some(Token::Punct('*')) => return (vec![path], i + 1),
            Some(Token::Ident(name)) => {
                path.push(name.clone());
                i += 1;
                if tokens.get(i).map(|t| &t.1) == Some(&Token::PathSep) {
                    i += 1;
                    continue;
                }
                // `as alias`
                if tokens.get(i).map(|t| &t.1) == Some(&Token::Ident("as".into())) {
                    i += 2;
                }
                return (vec![path], i);
            }
            _ => return (vec![path], i),
        }
    }
}

/// A path from the crate root for `crate::…`, `super::…` and `self::…`
/// written in module `here`; `None` for what names the crate root itself.
fn resolve(path: &[String], here: &[String]) -> Option<Vec<String>> {
    let mut base: Vec<String> = here.to_vec();
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => base.clear(),
        Some("self") => {}
        Some("super") => {
            base.pop();
        }
        _ => return None,
    }
    rest = &rest[1..];
    while rest.first().is_some_and(|s| s == "super") {
        base.pop();
        rest = &rest[1..];
    }
    base.extend(rest.iter().cloned());
    (!base.is_empty()).then_some(base)
}

/// `source` with comments, string and character literals blanked out
/// (new lines kept, so line numbers hold).
fn code_only(source: &str) -> String {
    let chars: Vec<char> = source.chars().collect();
    let mut out = String::with_capacity(source.len());
    let blank = |out: &mut String, c: char| out.push(if c == '\n' { '\n' } else { ' ' });
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    blank(&mut out, chars[i]);
                    i += 1;
                }
            }
        } else if (c == 'r' || (c == 'b' && next == Some('r')))
            && (i == 0 || !ident(chars[i - 1]))
            && {
                let mut j = i + if c == 'b' { 2 } else { 1 };
                while chars.get(j) == Some(&'#') {
                    j += 1;
                }
                chars.get(j) == Some(&'"')
            }
        {
            // r"…", r#"…"#, br#"…"#
            let mut j = i + if c == 'b' { 2 } else { 1 };
            let mut hashes = 0;
            while chars[j] == '#' {
                hashes += 1;
                j += 1;
            }
            j += 1;
            while j < chars.len() {
                if chars[j] == '"' && (0..hashes).all(|h| chars.get(j + 1 + h) == Some(&'#')) {
                    j += 1 + hashes;
                    break;
                }
                blank(&mut out, chars[j]);
                j += 1;
            }
            i = j;
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                if chars[i] == '\\' {
                    i += 1;
                }
                if let Some(&c) = chars.get(i) {
                    blank(&mut out, c);
                }
                i += 1;
            }
            i += 1;
        } else if c == '\'' && next == Some('\\') {
            // '\n', '\'', '\u{..}'
            i += 2;
            while i < chars.len() && chars[i] != '\'' {
                i += 1;
            }
            i += 1;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            i += 3;
        } else {
            // A lifetime's quote, or code.
            out.push(c);
            i += 1;
        }
    }
    out
}

/// Identifiers, `::` and single punctuation, each with its line.
fn tokenize(code: &str) -> Vec<(usize, Token)> {
    let chars: Vec<char> = code.chars().collect();
    let mut tokens = Vec::new();
    let mut line = 1;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c.is_alphabetic() || c == '_' {
            let start = i;
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
            tokens.push((line, Token::Ident(chars[start..i].iter().collect())));
        } else if c.is_ascii_digit() {
            while i < chars.len() && (chars[i].is_alphanumeric() || chars[i] == '_') {
                i += 1;
            }
        } else if c == ':' && chars.get(i + 1) == Some(&':') {
            tokens.push((line, Token::PathSep));
            i += 2;
        } else {
            tokens.push((line, Token::Punct(c)));
            i += 1;
        }
    }
    tokens
}
