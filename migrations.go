package main

import (
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"io/fs"
	"slices"
	"strconv"
	"time"

	"github.com/golang-migrate/migrate/v4"
	"github.com/golang-migrate/migrate/v4/database"
	pgxmigrate "github.com/golang-migrate/migrate/v4/database/pgx/v5"
	"github.com/golang-migrate/migrate/v4/source/iofs"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// The schema ships inside the binary, so the binary and its migrations can
// never disagree about which version they expect.
//
//go:embed migrations/*.sql
var migrationFiles embed.FS

// Migration modes (KUMIKO_MIGRATIONS_MODE).
const (
	migrationsExitOnPending = "exit-on-pending"
	migrationsAutoApply     = "auto-apply"
	migrationsWarnOnPending = "warn-on-pending"
)

// migrator wraps golang-migrate. golang-migrate holds a Postgres advisory
// lock while it works, so two instances that auto-apply at the same moment
// serialise: the second finds nothing left to do.
type migrator struct {
	m        *migrate.Migrate
	driver   database.Driver
	conns    *sql.DB
	versions []uint // every version the binary ships, ascending
}

// newMigrator opens the migrator on connections of its own, made like the
// pool's but not taken from it: golang-migrate waits for its advisory lock
// with no context to cancel, and a boot aborted during that wait must not
// leave the pool's Close waiting for the connection. On these connections
// lock_timeout bounds that wait, and statement_timeout every migration, to
// wait (the phase timeout).
func newMigrator(pool *pgxpool.Pool, wait time.Duration) (*migrator, error) {
	src, err := iofs.New(migrationFiles, "migrations")
	if err != nil {
		return nil, fmt.Errorf("reading the embedded migrations: %w", err)
	}
	versions, err := embeddedVersions()
	if err != nil {
		return nil, err
	}
	cc := pool.Config().ConnConfig // a copy
	ms := strconv.FormatInt(wait.Milliseconds(), 10)
	cc.RuntimeParams["lock_timeout"], cc.RuntimeParams["statement_timeout"] = ms, ms
	conns := stdlib.OpenDB(*cc)
	driver, err := pgxmigrate.WithInstance(conns, &pgxmigrate.Config{})
	if err != nil {
		conns.Close()
		return nil, fmt.Errorf("preparing the migrations table: %w", err)
	}
	m, err := migrate.NewWithInstance("iofs", src, "pgx5", driver)
	if err != nil {
		driver.Close()
		conns.Close()
		return nil, fmt.Errorf("creating the migrator: %w", err)
	}
	return &migrator{m: m, driver: driver, conns: conns, versions: versions}, nil
}

// embeddedVersions lists the versions of the *.up.sql files in the binary.
func embeddedVersions() ([]uint, error) {
	names, err := fs.Glob(migrationFiles, "migrations/*.up.sql")
	if err != nil {
		return nil, fmt.Errorf("listing the embedded migrations: %w", err)
	}
	var versions []uint
	for _, name := range names {
		var v uint
		if _, err := fmt.Sscanf(name, "migrations/%d_", &v); err != nil {
			return nil, fmt.Errorf("migration %s has no numeric version prefix: %w", name, err)
		}
		versions = append(versions, v)
	}
	slices.Sort(versions)
	return versions, nil
}

// Close releases the migrator's connections (the pool stays open).
func (mg *migrator) Close() error {
	srcErr, dbErr := mg.m.Close()
	return errors.Join(srcErr, dbErr, mg.conns.Close())
}

// schemaStatus is where the database is relative to the binary.
type schemaStatus struct {
	Version uint // 0: never migrated
	Dirty   bool
	Latest  uint // newest version the binary ships
	Pending []uint
}

// status reads the version under the migration lock: while another instance
// applies a migration the version row is marked dirty, and an unlocked read
// would mistake that for a migration that failed half-way.
func (mg *migrator) status() (schemaStatus, error) {
	if err := mg.driver.Lock(); err != nil {
		return schemaStatus{}, fmt.Errorf("taking the migration lock: %w", err)
	}
	defer mg.driver.Unlock()
	st := schemaStatus{}
	if len(mg.versions) > 0 {
		st.Latest = mg.versions[len(mg.versions)-1]
	}
	v, dirty, err := mg.m.Version()
	switch {
	case errors.Is(err, migrate.ErrNilVersion):
	case err != nil:
		return st, fmt.Errorf("reading the schema version: %w", err)
	default:
		st.Version, st.Dirty = v, dirty
	}
	for _, v := range mg.versions {
		if v > st.Version {
			st.Pending = append(st.Pending, v)
		}
	}
	return st, nil
}

// up applies every pending migration, stopping between two migrations when ctx ends.
func (mg *migrator) up(ctx context.Context) error {
	return mg.withContext(ctx, mg.m.Up)
}

// force records version as the schema's version and clears the dirty flag,
// without running anything: the repair after a migration failed half-way.
func (mg *migrator) force(version int) error {
	if err := mg.m.Force(version); err != nil {
		return fmt.Errorf("forcing version %d: %w", version, err)
	}
	return nil
}

// down rolls back n migrations.
func (mg *migrator) down(ctx context.Context, n int) error {
	return mg.withContext(ctx, func() error { return mg.m.Steps(-n) })
}

// withContext runs a golang-migrate call that knows no context: on ctx's end it
// asks for a graceful stop, which golang-migrate honours between migrations (a
// migration is never cut in half).
func (mg *migrator) withContext(ctx context.Context, fn func() error) error {
	stop := context.AfterFunc(ctx, func() {
		select {
		case mg.m.GracefulStop <- true:
		default:
		}
	})
	defer stop()
	err := fn()
	if errors.Is(err, migrate.ErrNoChange) {
		return nil
	}
	if err == nil && ctx.Err() != nil {
		return fmt.Errorf("migrations stopped early: %w", context.Cause(ctx))
	}
	return err
}

// ---------------------------------------------------------------------------
// Phases 8 and 9

// schemaBaseline is phase 8. It refuses a database that this binary can no longer migrate:
// a dirty one (a migration failed half-way and needs a human) or one older than
// the baseline the binary's migrations start from. A fresh database is left to
// phase 9.
func (a *app) schemaBaseline(ctx context.Context, p *phaseRun) error {
	baseline := a.cfg.Lifecycle.Migrations.SchemaBaseline
	if baseline == 0 {
		return skipPhase("KUMIKO_SCHEMA_BASELINE is not set")
	}
	mg, err := newMigrator(a.db, a.timeouts.phase)
	if err != nil {
		return err
	}
	defer mg.Close()
	st, err := mg.status()
	if err != nil {
		return err
	}
	switch {
	case st.Dirty:
		return dirtySchema(st.Version)
	case st.Version == 0:
		p.note = "fresh database: phase migrationsCheck creates the schema"
	case st.Version < baseline:
		return fmt.Errorf("schema version %d is older than baseline %d that this binary supports: migrate with an older release first", st.Version, baseline)
	}
	return nil
}

// dirtySchema is the error for a migration that failed half-way: only a human
// can tell what it left behind.
func dirtySchema(version uint) error {
	return fmt.Errorf("schema version %d is dirty: a migration failed half-way; repair the schema by hand, then record the version it is really at with `kumiko-lifecycle-demo migrate force N`", version)
}

// migrationsCheck is phase 9: it applies or reports pending migrations per KUMIKO_MIGRATIONS_MODE.
func (a *app) migrationsCheck(ctx context.Context, p *phaseRun) error {
	mode := a.cfg.Lifecycle.Migrations.Mode
	mg, err := newMigrator(a.db, a.timeouts.phase)
	if err != nil {
		return err
	}
	defer mg.Close()
	st, err := mg.status()
	if err != nil {
		return err
	}
	if st.Dirty {
		return dirtySchema(st.Version)
	}
	if st.Version > st.Latest {
		// A rolled-back binary during a rolling deploy: expected, and the schema
		// must stay compatible with it (expand/contract migrations).
		p.warn(fmt.Sprintf("schema version %d is newer than this binary's %d (older binary during a deploy?)", st.Version, st.Latest))
		return nil
	}
	if len(st.Pending) == 0 {
		p.note = fmt.Sprintf("schema at version %d, mode %s", st.Version, mode)
		return nil
	}
	switch mode {
	case migrationsAutoApply:
		if err := mg.up(ctx); err != nil {
			return fmt.Errorf("applying migrations %v: %w", st.Pending, err)
		}
		p.note = fmt.Sprintf("applied up to version %d (mode %s)", st.Latest, mode)
		return nil
	case migrationsWarnOnPending:
		p.warn(fmt.Sprintf("%d pending migrations %v (db at %d); running on the old schema", len(st.Pending), st.Pending, st.Version))
		return nil
	default:
		return fmt.Errorf("%d pending migrations %v (db at version %d, binary at %d): run `kumiko-lifecycle-demo migrate up` or set KUMIKO_MIGRATIONS_MODE=auto-apply",
			len(st.Pending), st.Pending, st.Version, st.Latest)
	}
}
