package main

import (
	"cmp"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The package is flat, but it has layers. The composition root wires
// everything, and its declarations (app, whose methods the phases are; the
// feature types) are everyone's; the core (the lifecycle, its listeners, config, telemetry, the
// database) names no building block and no demo; a building block names the
// core, the blocks it is built on and no demo; the demo may name anything.
// A block is its files: its name and the files that start with it.
var (
	layerRoot = []string{"main.go", "run.go", "app.go", "boot.go", "features.go"}
	// blocks and what each is built on.
	layerBlocks = map[string][]string{
		"redis":     nil,
		"heartbeat": {"redis"},
		"jobs":      nil,
		"backlog":   {"jobs"},
		"outbox":    {"redis", "jobs", "heartbeat"},
		"events":    {"outbox"},
		"sse":       {"outbox", "redis"},
		"leader":    {"redis", "jobs", "heartbeat"},
		"cron":      {"leader", "jobs", "heartbeat"},
		"dashboard": {"redis", "heartbeat", "leader", "sse"},
		"search":    nil,
		"storage":   nil,
	}
	layerDemos = []string{ // the demos' file prefixes; a copy without them has none
		"orders", // demo:begin (this line) demo:end
	}
)

// layerOf names the layer of a file: "root", "core", "demo" or a block's name.
func layerOf(file string) string {
	name := strings.TrimSuffix(file, ".go")
	switch {
	case slices.Contains(layerRoot, file):
		return "root"
	}
	for _, d := range layerDemos {
		if name == d || strings.HasPrefix(name, d+"_") {
			return "demo"
		}
	}
	for b := range layerBlocks {
		if name == b || strings.HasPrefix(name, b+"_") {
			return b
		}
	}
	return "core"
}

// mayName reports whether a file of layer from may name a declaration of
// layer to.
func mayName(from, to string) bool {
	switch {
	case from == to, from == "root", from == "demo", to == "core", to == "root":
		return true // the root's declarations (app, the feature types) are everyone's
	case from == "core", to == "demo":
		return false
	}
	return slices.Contains(layerBlocks[from], to)
}

// parseSources parses the package's non-test files in dir, by file name.
func parseSources(t *testing.T, dir string) map[string]*ast.File {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	parsed := map[string]*ast.File{}
	for _, path := range files {
		if strings.HasSuffix(path, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, path, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		parsed[filepath.Base(path)] = f
	}
	return parsed
}

// layerCrossings reads the package's non-test files and lists, as
// "from.go → to.go: name", every package-level name a file uses that is
// declared in a file of a layer it may not name. Identifiers are resolved
// by the parser within their file (a local that shadows a package-level name
// is not a use of it); selectors and composite-literal keys are fields or
// methods, not package-level names, and are not counted.
func layerCrossings(t *testing.T, dir string) []string {
	t.Helper()
	parsed := parseSources(t, dir)
	declaredIn := map[string]string{}
	for file, f := range parsed {
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil {
					declaredIn[d.Name.Name] = file
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						declaredIn[s.Name.Name] = file
					case *ast.ValueSpec:
						for _, n := range s.Names {
							declaredIn[n.Name] = file
						}
					}
				}
			}
		}
	}
	seen := map[string]bool{}
	for _, file := range slices.Sorted(maps.Keys(parsed)) {
		from := layerOf(file)
		skip := map[*ast.Ident]bool{}
		ast.Inspect(parsed[file], func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.FuncDecl:
				skip[n.Name] = true // a method's name is no use of a package-level one
			case *ast.SelectorExpr:
				skip[n.Sel] = true
			case *ast.CompositeLit:
				for _, e := range n.Elts {
					if kv, ok := e.(*ast.KeyValueExpr); ok {
						if id, ok := kv.Key.(*ast.Ident); ok {
							skip[id] = true
						}
					}
				}
			case *ast.Ident:
				decl, ok := declaredIn[n.Name]
				if !ok || skip[n] || n.Obj != nil || decl == file {
					return true
				}
				if to := layerOf(decl); !mayName(from, to) {
					seen[fmt.Sprintf("%s → %s: %s", file, decl, n.Name)] = true
				}
			}
			return true
		})
	}
	return slices.SortedFunc(maps.Keys(seen), func(a, b string) int { return cmp.Compare(a, b) })
}

func TestNoFileCrossesALayer(t *testing.T) {
	for _, c := range layerCrossings(t, ".") {
		t.Errorf("a reference across layers (root, core, blocks, demo; see layerBlocks): %s", c)
	}
}
