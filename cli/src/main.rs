fn main() -> std::process::ExitCode {
    m3c::main()
}
