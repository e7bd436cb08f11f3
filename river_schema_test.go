package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// River's schema arrives as our migrations 3, 4, …, one per River migration
// (each must run in its own transaction, as River runs them), so River's
// tables go through the same migration story (modes, lock, status) as ours.
const riverFirstMigration = 3

// riverMigrations returns file name → content for River's bundled migrations
// in the River version of go.mod. River marks where a schema name may go with
// /* TEMPLATE: schema */ — also inside string literals — and, like River for
// the default schema, we fill in nothing. The last one also writes River's own
// bookkeeping rows, so River's migrator agrees that they were applied.
func riverMigrations(t testing.TB) map[string]string {
	m, err := rivermigrate.New(riverpgxv5.New(nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	const header = "-- River's schema migration %03d (%s), generated from River's bundled migrations by\n" +
		"-- river_schema_test.go (KUMIKO_REGENERATE=1 go test -run TestRiverMigrations .). Do not edit.\n\n"
	files := map[string]string{}
	versions := m.AllVersions()
	for i, v := range versions {
		base := fmt.Sprintf("migrations/%06d_river_%03d_%s", riverFirstMigration+i, v.Version, strings.ReplaceAll(v.Name, " ", "_"))
		up, down := fmt.Sprintf(header, v.Version, v.Name)+untemplate(v.SQLUp)+"\n", fmt.Sprintf(header, v.Version, v.Name)
		if i == len(versions)-1 {
			var marks []string
			for _, w := range versions {
				marks = append(marks, fmt.Sprintf("('main', %d)", w.Version))
			}
			up += fmt.Sprintf("\nINSERT INTO river_migration (line, version) VALUES %s;\n", strings.Join(marks, ", "))
			down += fmt.Sprintf("DELETE FROM river_migration WHERE line = 'main' AND version <= %d;\n", v.Version)
		}
		files[base+".up.sql"], files[base+".down.sql"] = up, down+untemplate(v.SQLDown)+"\n"
	}
	return files
}

func untemplate(sql string) string {
	return strings.TrimSpace(strings.ReplaceAll(sql, "/* TEMPLATE: schema */", ""))
}

// The River migrations must be exactly River's schema for the River version
// in go.mod: upgrading River without adding its new migrations fails here.
func TestRiverMigrationsAreRiversOwn(t *testing.T) {
	want := riverMigrations(t)
	if os.Getenv("KUMIKO_REGENERATE") == "1" {
		for name, content := range want {
			os.WriteFile(name, []byte(content), 0o644)
		}
	}
	have, _ := filepath.Glob("migrations/*_river_*.sql")
	if len(have) != len(want) {
		t.Errorf("%d River migration files, River has %d", len(have), len(want))
	}
	for name, content := range want {
		if got, err := os.ReadFile(name); err != nil || string(got) != content {
			t.Errorf("%s is not River's migration (%v): regenerate, and add River's new versions as NEW migrations", name, err)
		}
	}
}

// After our migrations, River's own migrator finds nothing left to do.
func TestRiverAgreesItsSchemaIsCurrent(t *testing.T) {
	pool := testPool(t)
	mg, err := newMigrator(pool, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer mg.Close()
	if err := mg.up(context.Background()); err != nil {
		t.Fatal(err)
	}
	rm, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		t.Fatal(err)
	}
	res, err := rm.Validate(context.Background(), nil)
	if err != nil || !res.OK {
		t.Fatalf("River's migrator disagrees: %v %+v", err, res)
	}
}
