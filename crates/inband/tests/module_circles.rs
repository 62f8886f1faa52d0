//! No module of the workspace's crates imports, directly or around a
//! circle, a module that imports it back: a circle makes every module in it
//! one piece that can only be read, tested and moved as a whole, and it is
//! how a product ends up importing its tests' tooling or another product.
//!
//! An import is any path that names a module of the same crate: `use`
//! declarations and paths in code (`crate::x::f()`, `super::Y`), macro
//! arguments included. Test modules (`#[cfg(test)]`) are left out: they may
//! use what they test from anywhere. Circles are looked for among the
//! children of every module, each child standing for all the modules below
//! it: two folders whose files name each other both ways are a circle, and
//! a child naming its parent's file (`lib.rs`, `mod.rs`: where its siblings
//! meet, as Rust's visibility rules make it) is not. Crates themselves
//! cannot import in a circle (cargo refuses it), but the products must not
//! lean on each other at all: each stands on `inband-core` alone, and the
//! balancer's build links neither the ILP solver nor QUIC.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use proc_macro2::{TokenStream, TokenTree};
use syn::visit::Visit;

/// A module that is a file, by its path in its crate (`[]` = the root).
type ModPath = Vec<String>;

/// One crate's module files and who imports whom (file -> file -> the
/// names taken).
struct Crate {
    files: BTreeMap<ModPath, PathBuf>,
    edges: BTreeMap<ModPath, BTreeMap<ModPath, BTreeSet<String>>>,
}

fn is_test_only(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("cfg") && a.meta.require_list().is_ok_and(|l| l.tokens.to_string().split(|c: char| !c.is_alphanumeric() && c != '_').any(|w| w == "test"))
    })
}

fn parse(file: &Path) -> syn::File {
    let text = std::fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    syn::parse_file(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", file.display()))
}

/// The module files reachable from `root` (lib.rs or main.rs) through
/// `mod name;` declarations.
fn module_files(root: &Path) -> BTreeMap<ModPath, PathBuf> {
    let mut files = BTreeMap::new();
    let mut todo = vec![(ModPath::new(), root.to_path_buf())];
    while let Some((path, file)) = todo.pop() {
        // A root or mod.rs holds its children beside it; a.rs holds them in a/.
        let dir = if path.is_empty() || file.file_name().is_some_and(|n| n == "mod.rs") {
            file.parent().unwrap().to_path_buf()
        } else {
            file.with_extension("")
        };
        for item in parse(&file).items {
            if let syn::Item::Mod(m) = item {
                if m.content.is_some() || is_test_only(&m.attrs) {
                    continue;
                }
                let name = m.ident.to_string();
                let child = [dir.join(format!("{name}.rs")), dir.join(&name).join("mod.rs")]
                    .into_iter()
                    .find(|f| f.exists())
                    .unwrap_or_else(|| panic!("{}: no file for `mod {name};`", file.display()));
                let mut p = path.clone();
                p.push(name);
                todo.push((p, child));
            }
        }
        files.insert(path, file);
    }
    files
}

/// Collects the paths one file names, each with the module it is named
/// from (an inline module inside the file changes what `self` and `super`
/// mean).
struct Paths {
    at: ModPath,
    found: Vec<(ModPath, Vec<String>)>,
}

impl Paths {
    fn use_tree(&mut self, prefix: &mut Vec<String>, tree: &syn::UseTree) {
        match tree {
            syn::UseTree::Path(p) => {
                prefix.push(p.ident.to_string());
                self.use_tree(prefix, &p.tree);
                prefix.pop();
            }
            syn::UseTree::Name(n) if n.ident == "self" => self.found.push((self.at.clone(), prefix.clone())),
            syn::UseTree::Name(n) => self.found.push((self.at.clone(), [prefix.as_slice(), &[n.ident.to_string()]].concat())),
            syn::UseTree::Rename(r) => self.found.push((self.at.clone(), [prefix.as_slice(), &[r.ident.to_string()]].concat())),
            syn::UseTree::Glob(_) => self.found.push((self.at.clone(), [prefix.as_slice(), &["*".to_string()]].concat())),
            syn::UseTree::Group(g) => {
                for t in &g.items {
                    self.use_tree(prefix, t);
                }
            }
        }
    }

    /// Paths inside a macro's arguments are tokens, not syntax: `a :: b :: c`.
    fn tokens(&mut self, tokens: TokenStream) {
        let flat: Vec<TokenTree> = tokens.into_iter().collect();
        let mut i = 0;
        while i < flat.len() {
            match &flat[i] {
                TokenTree::Group(g) => self.tokens(g.stream()),
                TokenTree::Ident(first) => {
                    let mut path = vec![first.to_string()];
                    let mut j = i + 1;
                    while let (Some(TokenTree::Punct(a)), Some(TokenTree::Punct(b)), Some(TokenTree::Ident(next))) =
                        (flat.get(j), flat.get(j + 1), flat.get(j + 2))
                    {
                        if a.as_char() != ':' || b.as_char() != ':' {
                            break;
                        }
                        path.push(next.to_string());
                        j += 3;
                    }
                    if path.len() > 1 {
                        self.found.push((self.at.clone(), path));
                        i = j;
                        continue;
                    }
                }
                _ => {}
            }
            i += 1;
        }
    }
}

impl<'ast> Visit<'ast> for Paths {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if is_test_only(&m.attrs) {
            return;
        }
        self.at.push(m.ident.to_string());
        syn::visit::visit_item_mod(self, m);
        self.at.pop();
    }

    fn visit_item_use(&mut self, u: &'ast syn::ItemUse) {
        self.use_tree(&mut Vec::new(), &u.tree);
    }

    fn visit_path(&mut self, p: &'ast syn::Path) {
        self.found.push((self.at.clone(), p.segments.iter().map(|s| s.ident.to_string()).collect()));
        syn::visit::visit_path(self, p);
    }

    fn visit_macro(&mut self, m: &'ast syn::Macro) {
        self.tokens(m.tokens.clone());
        syn::visit::visit_macro(self, m);
    }

    /// `pub(crate)`, `pub(super)`: who may see, not an import.
    fn visit_visibility(&mut self, _: &'ast syn::Visibility) {}

    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !is_test_only(&f.attrs) {
            syn::visit::visit_item_fn(self, f);
        }
    }
}

/// The module file a path from module `at` names, and the name it takes
/// from it; None for what is not a module of this crate (std, other crates,
/// locals).
fn resolve(files: &BTreeMap<ModPath, PathBuf>, at: &ModPath, path: &[String]) -> Option<(ModPath, String)> {
    let mut target: ModPath = match path.first()?.as_str() {
        "crate" => Vec::new(),
        "self" | "super" => at.clone(),
        _ => return None,
    };
    let mut rest = path.iter().skip(usize::from(matches!(path[0].as_str(), "crate" | "self" | "super"))).peekable();
    if path[0] == "super" {
        target.pop()?;
        while rest.peek().is_some_and(|s| *s == "super") {
            rest.next();
            target.pop()?;
        }
    }
    let mut name = String::new();
    for seg in rest {
        let next = [target.as_slice(), &[seg.clone()]].concat();
        if files.contains_key(&next) {
            target = next;
        } else {
            name = seg.clone();
            break;
        }
    }
    // An inline module is part of its file.
    while !files.contains_key(&target) {
        target.pop()?;
    }
    Some((target, name))
}

fn read_crate(root: &Path) -> Crate {
    let files = module_files(root);
    let mut edges: BTreeMap<ModPath, BTreeMap<ModPath, BTreeSet<String>>> = BTreeMap::new();
    for (module, file) in &files {
        let mut paths = Paths { at: module.clone(), found: Vec::new() };
        paths.visit_file(&parse(file));
        for (at, path) in paths.found {
            if let Some((to, name)) = resolve(&files, &at, &path) {
                if to != *module {
                    edges.entry(module.clone()).or_default().entry(to).or_default().insert(name);
                }
            }
        }
    }
    Crate { files, edges }
}

type Graph = BTreeMap<ModPath, BTreeSet<ModPath>>;

/// The strongly connected sets of more than one node (Tarjan).
fn circles(g: &Graph) -> Vec<Vec<ModPath>> {
    struct Walk<'a> {
        g: &'a Graph,
        index: BTreeMap<&'a ModPath, usize>,
        low: BTreeMap<&'a ModPath, usize>,
        stack: Vec<&'a ModPath>,
        on_stack: BTreeSet<&'a ModPath>,
        out: Vec<Vec<ModPath>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, m: &'a ModPath) {
            let i = self.index.len();
            self.index.insert(m, i);
            self.low.insert(m, i);
            self.stack.push(m);
            self.on_stack.insert(m);
            for to in self.g.get(m).into_iter().flatten() {
                if !self.index.contains_key(to) {
                    self.visit(to);
                    let l = self.low[to].min(self.low[m]);
                    self.low.insert(m, l);
                } else if self.on_stack.contains(to) {
                    let l = self.index[to].min(self.low[m]);
                    self.low.insert(m, l);
                }
            }
            if self.low[m] == self.index[m] {
                let mut set = Vec::new();
                loop {
                    let top = self.stack.pop().unwrap();
                    self.on_stack.remove(top);
                    set.push(top.clone());
                    if top == m {
                        break;
                    }
                }
                if set.len() > 1 {
                    set.sort();
                    self.out.push(set);
                }
            }
        }
    }
    let mut w = Walk { g, index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on_stack: BTreeSet::new(), out: Vec::new() };
    for m in g.keys() {
        if !w.index.contains_key(m) {
            w.visit(m);
        }
    }
    w.out
}

/// Each circle of the crate at `root`, as its imports: `a.rs -> b.rs: X,
/// Y`. Looked for among the children of every module, each child standing
/// for all the modules below it: `lb` and `agent` importing each other is a
/// circle even when no two of their files do.
fn describe(root: &Path) -> Vec<String> {
    let c = read_crate(root);
    let base = root.parent().unwrap();
    let show = |m: &ModPath| c.files[m].strip_prefix(base).unwrap().display().to_string();
    let mut out = Vec::new();
    for parent in c.files.keys() {
        let child = |m: &ModPath| (m.len() > parent.len() && m.starts_with(parent)).then(|| m[..=parent.len()].to_vec());
        let mut g = Graph::new();
        for (from, tos) in &c.edges {
            for to in tos.keys() {
                if let (Some(a), Some(b)) = (child(from), child(to)) {
                    if a != b {
                        g.entry(a).or_default().insert(b);
                    }
                }
            }
        }
        for set in circles(&g) {
            let mut lines = Vec::new();
            for (from, tos) in &c.edges {
                for (to, names) in tos {
                    if let (Some(a), Some(b)) = (child(from), child(to)) {
                        if a != b && set.contains(&a) && set.contains(&b) {
                            let names: Vec<&str> = names.iter().map(|n| if n.is_empty() { "(the module)" } else { n.as_str() }).collect();
                            lines.push(format!("  {} -> {}: {}", show(from), show(to), names.join(", ")));
                        }
                    }
                }
            }
            let members: Vec<String> = set.iter().map(|m| m.join("::")).collect();
            out.push(format!("circle of {}:\n{}", members.join(", "), lines.join("\n")));
        }
    }
    out
}

#[test]
fn no_module_of_any_crate_imports_in_a_circle() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut found = Vec::new();
    let mut roots = 0;
    for entry in std::fs::read_dir(crates).unwrap() {
        let src = entry.unwrap().path().join("src");
        for root in [src.join("lib.rs"), src.join("main.rs")] {
            if root.exists() {
                roots += 1;
                found.extend(describe(&root).into_iter().map(|c| format!("{}: {c}", root.display())));
            }
        }
    }
    assert!(roots >= 4, "found {roots} crate roots under {}", crates.display());
    assert!(found.is_empty(), "modules that import each other (move what both need below both):\n{}", found.join("\n"));
}

/// The reader sees each way a module can name another: `use` with groups
/// and `self`, a path in code, in a type, inside a macro; circles of
/// folders; and not what test code names.
#[test]
fn the_reader_finds_a_circle_of_each_kind_of_import() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let f = dir.path().join(name);
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, text).unwrap();
    };
    let circle = |lib: &str, a: &str, b: &str| {
        write("lib.rs", lib);
        write("a/mod.rs", &format!("pub mod b;\n{a}"));
        write("a/b.rs", b);
        describe(&dir.path().join("lib.rs"))
    };
    let lib = "pub mod a;\npub mod c;\npub struct Root;\n";
    write("c.rs", "pub fn f() {}\npub struct C;\n");
    let b_uses_c = "use crate::c::C;\n";
    assert_eq!(circle(lib, "", b_uses_c), Vec::<String>::new(), "no circle");
    for (c_text, what) in [
        ("use crate::a::{self, b::Thing};\n", "a use group with self"),
        ("pub fn g() { crate::a::b::h(); }\n", "a path in code"),
        ("pub fn g() { println!(\"{:?}\", crate::a::b::h()); }\n", "a path in a macro"),
        ("pub fn g() -> Option<crate::a::b::T> { None }\n", "a path in a type"),
    ] {
        write("c.rs", c_text);
        let found = circle(lib, "", b_uses_c);
        assert_eq!(found.len(), 1, "{what}: {found:?}");
        assert!(found[0].contains("a/b.rs -> c.rs: C") && found[0].contains("c.rs -> a/b.rs"), "{what}: {found:?}");
    }
    write("c.rs", "pub struct C;\n");
    let found = circle(lib, "pub fn g() { b::h(); }\n", "use super::g;\nuse super::super::Root;\n");
    assert!(found.is_empty(), "a module naming its ancestors makes no circle: {found:?}");
    write("c.rs", "pub struct C;\n");
    write("d/mod.rs", "pub mod e;\n");
    write("d/e.rs", "pub fn f() {}\n");
    let found = circle("pub mod a;\npub mod c;\npub mod d;\n", "pub fn g() { crate::d::e::f(); }\n", "pub struct T;\n");
    assert!(found.is_empty(), "{found:?}");
    write("d/e.rs", "pub fn f() -> crate::a::b::T { crate::a::b::T }\n");
    let found = circle("pub mod a;\npub mod c;\npub mod d;\n", "pub fn g() { crate::d::e::f(); }\n", "pub struct T;\n");
    assert_eq!(found.len(), 1, "two folders naming each other, no two files: {found:?}");
    assert!(found[0].starts_with("circle of a, d:"), "{found:?}");
    std::fs::remove_dir_all(dir.path().join("d")).unwrap();
    let test_only = "#[cfg(test)]\nmod tests { use crate::a::b::h; }\n#[cfg(test)]\nfn t() { crate::a::b::h(); }\n";
    write("c.rs", test_only);
    assert!(circle(lib, "", b_uses_c).is_empty(), "test code is left out");
}

/// The workspace crates' dependencies (normal and build, not dev) by name,
/// from their manifests.
fn workspace_dependencies() -> BTreeMap<String, BTreeSet<String>> {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(crates).unwrap() {
        let manifest = entry.unwrap().path().join("Cargo.toml");
        let Ok(text) = std::fs::read_to_string(&manifest) else { continue };
        let t: toml::Table = text.parse().unwrap();
        let name = t["package"]["name"].as_str().unwrap().to_string();
        let deps = ["dependencies", "build-dependencies"]
            .iter()
            .filter_map(|k| t.get(*k).and_then(|d| d.as_table()))
            .flat_map(|d| d.keys().cloned())
            .collect();
        out.insert(name, deps);
    }
    out
}

/// Everything `name` links, following workspace crates down.
fn closure(all: &BTreeMap<String, BTreeSet<String>>, name: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut todo = vec![name.to_string()];
    while let Some(n) = todo.pop() {
        for d in all.get(&n).into_iter().flatten() {
            if seen.insert(d.clone()) {
                todo.push(d.clone());
            }
        }
    }
    seen
}

#[test]
fn products_stand_on_the_core_alone() {
    let all = workspace_dependencies();
    let products = ["inband-lb", "inband-agent", "inband-mesh", "inband-shadow", "inband-weights", "inband-proxy", "inband-trace"];
    let above_products = ["inband", "inband-testkit"];
    let mut wrong = Vec::new();
    for p in products {
        let deps = all.get(p).unwrap_or_else(|| panic!("{p} is not in the workspace"));
        for d in deps.iter().filter(|d| products.contains(&d.as_str()) || above_products.contains(&d.as_str())) {
            wrong.push(format!("{p} depends on {d}"));
        }
    }
    // Layers the products may stand on besides the core (TCPE's options,
    // for the proxy, the agent and the client library to come) lean on no
    // product either.
    for layer in ["inband-tcpe"] {
        let deps = all.get(layer).unwrap_or_else(|| panic!("{layer} is not in the workspace"));
        for d in deps.iter().filter(|d| products.contains(&d.as_str()) || above_products.contains(&d.as_str())) {
            wrong.push(format!("{layer} depends on {d}"));
        }
    }
    for heavy in ["good_lp", "quinn", "quinn-proto", "rustls", "rocksdb", "heed"] {
        if closure(&all, "inband-lb").contains(heavy) {
            wrong.push(format!("inband-lb links {heavy}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The check sees what it looks for.
    assert!(closure(&all, "inband-weights").contains("good_lp"));
    assert!(closure(&all, "inband").contains("inband-core"));
}
