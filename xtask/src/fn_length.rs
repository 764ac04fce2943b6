//! No function outside tests is longer than [`MAX_FN_LINES`] lines: part of
//! `cargo xtask layers` (CI's `layers` step), like rust-analyzer's tidy
//! tests. A function that long does several things a reader would name;
//! split it by those steps (docs/ARCHITECTURE.md, "Invariants").
//!
//! Read with `syn` from the sources (no build). A function's length runs
//! from its `fn` keyword to its closing brace, comments and blank lines
//! included (what a reader scrolls through); its doc comment and
//! attributes are not counted. Test code is not read: `#[test]`-like
//! functions (any attribute whose last segment is `test`), `#[cfg(test)]`
//! items, and the `tests/`, `benches/`, `examples/` and fuzz directories.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use syn::visit::Visit;

use crate::util;

/// The longest a function may be, in lines.
pub const MAX_FN_LINES: usize = 150;

/// Directories whose sources are checked: every crate's `src/` and the
/// xtask's own.
fn source_roots() -> Result<Vec<PathBuf>> {
    let root = util::repo_root();
    let mut roots = vec![root.join("xtask/src")];
    for entry in std::fs::read_dir(root.join("crates")).context("listing crates/")? {
        let src = entry?.path().join("src");
        if src.is_dir() {
            roots.push(src);
        }
    }
    roots.sort();
    Ok(roots)
}

/// Every function longer than [`MAX_FN_LINES`] in the workspace's
/// production sources, as `path:line: …`.
pub fn over_limit() -> Result<Vec<String>> {
    let root = util::repo_root();
    let mut found = Vec::new();
    for path in util::rust_files(source_roots()?)? {
        let text = std::fs::read_to_string(&path)?;
        let shown = path.strip_prefix(&root).unwrap_or(&path);
        found.extend(long_functions(shown, &text)?);
    }
    found.sort();
    Ok(found)
}

/// The functions of one source file longer than [`MAX_FN_LINES`].
pub fn long_functions(path: &Path, source: &str) -> Result<Vec<String>> {
    let file = syn::parse_file(source).with_context(|| format!("parsing {}", path.display()))?;
    let mut finder = Finder {
        path,
        found: Vec::new(),
    };
    finder.visit_file(&file);
    Ok(finder.found)
}

struct Finder<'a> {
    path: &'a Path,
    found: Vec<String>,
}

impl Finder<'_> {
    fn check(&mut self, name: &syn::Ident, fn_token: &syn::token::Fn, block: &syn::Block) {
        let first = fn_token.span.start().line;
        let last = block.brace_token.span.close().end().line;
        let lines = last + 1 - first;
        if lines > MAX_FN_LINES {
            self.found.push(format!(
                "{}:{first}: fn {name} is {lines} lines (at most {MAX_FN_LINES}: split it by its steps)",
                self.path.display()
            ));
        }
    }
}

/// `#[test]`, `#[tokio::test(…)]` and the like, or `#[cfg(test)]`.
fn is_test_code(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|attr| {
        let path = attr.path();
        if path.segments.last().is_some_and(|s| s.ident == "test") {
            return true;
        }
        path.is_ident("cfg")
            && matches!(&attr.meta, syn::Meta::List(list) if list.tokens.to_string() == "test")
    })
}

impl<'ast> Visit<'ast> for Finder<'_> {
    fn visit_item_mod(&mut self, item: &'ast syn::ItemMod) {
        if !is_test_code(&item.attrs) {
            syn::visit::visit_item_mod(self, item);
        }
    }

    fn visit_item_impl(&mut self, item: &'ast syn::ItemImpl) {
        if !is_test_code(&item.attrs) {
            syn::visit::visit_item_impl(self, item);
        }
    }

    fn visit_item_fn(&mut self, item: &'ast syn::ItemFn) {
        if is_test_code(&item.attrs) {
            return;
        }
        self.check(&item.sig.ident, &item.sig.fn_token, &item.block);
        syn::visit::visit_item_fn(self, item);
    }

    fn visit_impl_item_fn(&mut self, item: &'ast syn::ImplItemFn) {
        if is_test_code(&item.attrs) {
            return;
        }
        self.check(&item.sig.ident, &item.sig.fn_token, &item.block);
        syn::visit::visit_impl_item_fn(self, item);
    }

    fn visit_trait_item_fn(&mut self, item: &'ast syn::TraitItemFn) {
        if let (false, Some(block)) = (is_test_code(&item.attrs), &item.default) {
            self.check(&item.sig.ident, &item.sig.fn_token, block);
        }
        syn::visit::visit_trait_item_fn(self, item);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A function of `body_lines` statements, doc-commented and attributed.
    fn function(name: &str, body_lines: usize, attr: &str) -> String {
        let body: String = (0..body_lines)
            .map(|i| format!("    let _x{i} = {i};\n"))
            .collect();
        format!("/// Docs.\n/// More docs.\n{attr}\nfn {name}() {{\n{body}}}\n")
    }

    fn found(source: &str) -> Vec<String> {
        long_functions(Path::new("x.rs"), source).unwrap()
    }

    #[test]
    fn a_planted_long_function_is_caught_with_its_line_and_length() {
        // 149 statements + the signature line + the closing brace = 151.
        let source = format!("use std::fmt;\n{}", function("long", MAX_FN_LINES - 1, ""));
        assert_eq!(
            found(&source),
            vec![format!(
                "x.rs:5: fn long is 151 lines (at most {MAX_FN_LINES}: split it by its steps)"
            )]
        );
        // At the limit is allowed; docs and attributes do not count.
        let at_limit = function("fits", MAX_FN_LINES - 2, "#[inline]");
        assert_eq!(found(&at_limit), Vec::<String>::new());
    }

    #[test]
    fn methods_trait_defaults_and_nested_functions_are_measured() {
        let long = function("inner", MAX_FN_LINES, "");
        let in_impl = format!("struct S;\nimpl S {{\n{long}}}\n");
        assert_eq!(found(&in_impl).len(), 1, "{in_impl}");
        let in_trait = format!("trait T {{\n{long}}}\n");
        assert_eq!(found(&in_trait).len(), 1);
        let nested = format!("fn outer() {{\n{long}}}\n");
        // Both the nested function and the one holding it are too long.
        assert_eq!(found(&nested).len(), 2);
    }

    #[test]
    fn test_code_is_not_read() {
        let long = function("case", MAX_FN_LINES, "#[test]");
        assert!(found(&long).is_empty());
        let tokio = function(
            "case",
            MAX_FN_LINES,
            "#[tokio::test(flavor = \"multi_thread\")]",
        );
        assert!(found(&tokio).is_empty());
        let module = format!(
            "#[cfg(test)]\nmod tests {{\n{}}}\n",
            function("helper", MAX_FN_LINES, "")
        );
        assert!(found(&module).is_empty());
        // `cfg(not(test))` is production code.
        let not_test = format!(
            "#[cfg(not(test))]\nmod real {{\n{}}}\n",
            function("helper", MAX_FN_LINES, "")
        );
        assert_eq!(found(&not_test).len(), 1);
    }
}
