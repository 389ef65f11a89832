//! The `m3c` command line, built inside the test package (see Cargo.toml).

fn main() -> std::process::ExitCode {
    m3c::main()
}
